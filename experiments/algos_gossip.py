"""Gossip methods for `experiments/train.py`: `--algo=dpsgd|choco --topology=ring|...`.

  python -m experiments.train --model=mlp --algo=dpsgd --topology=torus --optimizer=sgd
  python -m experiments.train --model=mlp --algo=choco --topology=ring --gossip_codec=bfloat16

Settings arrive in `cfg.extra`: `topology` (a name in `jaxcomm.sync.GRAPHS`), `gossip_codec`
(`identity`, a cast dtype such as `bfloat16`, or `name:arg` for any `jaxcomm.codecs` factory,
e.g. `top_k:0.01` once that codec exists), `consensus_step` (CHOCO's gamma) and
`num_workers` (defaults to the device count, the data axis of train.py's mesh).
"""

from __future__ import annotations

import jax
import optax

from experiments import builders
from jaxcomm import codecs, sync


def _graph(cfg: builders.Config) -> sync.GossipGraph:
  num_workers = cfg.extra.get("num_workers") or jax.device_count()
  return sync.gossip_graph(cfg.extra.get("topology") or "ring", num_workers)


def gossip_codec(spec: str) -> codecs.Codec:
  """A codec from a command-line spec: `identity`, a cast dtype, or `factory:arg`."""
  name, _, arg = spec.partition(":")
  if name == "identity":
    return codecs.identity()
  if name in ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
    return codecs.cast(name)
  factory = getattr(codecs, name, None)
  if not callable(factory) or name in ("Codec", "flatten"):
    allowed = sorted(n for n in codecs.__all__ if n not in ("Codec", "flatten"))
    raise ValueError(f"gossip_codec {spec!r} is unknown; allowed: {', '.join(allowed)} "
                     "(optionally name:arg) or a cast dtype.")
  return factory(float(arg)) if arg else factory()


@builders.algorithm("dpsgd")
def _dpsgd(cfg: builders.Config, inner: optax.GradientTransformation):
  return sync.dpsgd(inner, _graph(cfg), axis_name=cfg.axis_name)


@builders.algorithm("choco")
def _choco(cfg: builders.Config, inner: optax.GradientTransformation):
  graph = _graph(cfg)
  if graph.period != 1:
    raise ValueError(f"choco needs a static topology; {graph.name!r} is time-varying "
                     "(use --algo=dpsgd for it).")
  return sync.choco(inner, graph, gossip_codec(cfg.extra.get("gossip_codec") or "bfloat16"),
                    consensus_step=float(cfg.extra.get("consensus_step") or 0.5),
                    axis_name=cfg.axis_name, key=jax.random.key(cfg.seed))
