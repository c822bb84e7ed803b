"""ZeRO as `--algo` choices, and the optimiser for a model laid out on a mesh (`--mesh`).

  python -m experiments.train --algo=zero1 --zero_codec=int8 --zero_memory=ef
  python -m experiments.train --mesh=data=2,fsdp=2,tensor=2
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from experiments import builders
from jaxcomm import codecs
from jaxcomm import parallel


def int8_codec() -> codecs.Codec:
  """Symmetric int8 with one float32 scale per encoded vector (round to nearest).

  Not linear (each worker has its own scale), so it needs a decode-then-sum collective.
  A stand-in until `jaxcomm.codecs` has its int-N family; built only from the Codec contract.
  """
  def encode(x, key):
    del key
    scale = jnp.maximum(jnp.max(jnp.abs(x)), 1e-30) / 127.0
    return (jnp.round(x / scale).astype(jnp.int8), scale.astype(jnp.float32)[None])

  def decode(payload, n):
    del n
    q, scale = payload
    return q.astype(jnp.float32) * scale[0]

  return codecs.Codec("int8", encode=encode, decode=decode, payload_bytes=lambda n: n + 4,
                      linear=False, error_bound=lambda x: jnp.max(jnp.abs(x)) / 254.0)


CODECS = {"none": lambda: None, "bf16": lambda: codecs.cast("bfloat16"), "int8": int8_codec}


def zero_codec(cfg: builders.Config):
  name = cfg.extra.get("zero_codec") or "none"
  if name not in CODECS:
    raise ValueError(f"zero_codec {name!r} is unknown; allowed: {', '.join(CODECS)}.")
  return CODECS[name]()


def _zero(stage):
  def build(cfg: builders.Config, inner: optax.GradientTransformation):
    return parallel.zero(inner, stage=stage, axis_name=cfg.axis_name, codec=zero_codec(cfg),
                         memory=cfg.extra.get("zero_memory"),
                         accumulate_steps=int(cfg.extra.get("accumulate_steps", 1)))
  return build


builders.algorithm("zero1")(_zero(1))
builders.algorithm("zero2")(_zero(2))


def layout_optimizer(cfg: builders.Config, layout: parallel.Layout, param_specs,
                     regather=None) -> optax.GradientTransformation:
  """`--algo`'s transform for a laid-out model.

  With parameters sharded over batch axes (`fsdp`), the inner optimiser is wrapped in
  `zero(stage=3)` over those axes and the algorithm synchronises over the remaining batch
  axes (`data`); tensor-parallel shards need nothing more.
  """
  inner = builders.inner_optimizer(cfg)
  gather = layout.gather_axes
  if gather:
    inner = parallel.zero(inner, stage=3, axis_name=gather, param_specs=param_specs,
                          regather=regather)
  rest = tuple(a for a in layout.batch_axes if a not in gather)
  cfg.axis_name = (rest[0] if len(rest) == 1 else rest) or None
  if cfg.algo not in builders.ALGORITHMS:
    raise ValueError(f"algo {cfg.algo!r} is unknown; allowed: "
                     f"{', '.join(sorted(builders.ALGORITHMS))}.")
  return builders.ALGORITHMS[cfg.algo](cfg, inner)
