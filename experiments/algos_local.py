"""Local-update methods for `experiments/train.py --algo=...` (jaxcomm.local).

Settings arrive in `cfg.extra` (train.py fills them from flags): sync_every, fragments,
overlap, merge_alpha, outer_codec, outer_memory, participation, outer_lr, outer_momentum,
density, sparse_bits, worker_steps, compensation and dc_lambda (streaming_diloco's
CoCoDC-style delay compensation), weighting, num_workers, and the mesh axes slow_axis /
fast_axis for `hierarchical`.
"""

from __future__ import annotations

import numpy as np
import optax

from experiments import builders
from jaxcomm import codecs, local

CODECS = ("none", "identity", "bf16", "fp16", "fp8", "auto")


def _codec(name: str | None, default):
  """A codec from its flag value; None keeps the method's default."""
  if name is None:
    return default
  table = {"none": None, "identity": codecs.identity(), "auto": "auto"}
  casts = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}
  if name in table:
    return table[name]
  if name in casts:
    return codecs.cast(casts[name])
  raise ValueError(f"codec {name!r} is unknown; allowed: {', '.join(CODECS)}.")


def participation_mask(spec: str | None, num_workers: int, num_syncs: int, seed: int = 0):
  """A bool[num_syncs, W] mask from a flag value, or None.

  `drop:2,5@3,4` drops workers 2 and 5 at syncs 3 and 4; `random:0.25` drops each worker
  with probability 0.25 at each sync (seeded; at least one worker stays live).

  >>> participation_mask("drop:1@0", 3, 2).astype(int).tolist()
  [[1, 0, 1], [1, 1, 1]]
  """
  if not spec:
    return None
  kind, _, arg = spec.partition(":")
  mask = np.ones((max(num_syncs, 1), num_workers), bool)
  if kind == "drop":
    workers, _, syncs = arg.partition("@")
    try:
      workers = [int(w) for w in workers.split(",")]
      syncs = [int(k) for k in syncs.split(",")] if syncs else list(range(len(mask)))
    except ValueError as e:
      raise ValueError(f"participation {spec!r}: expected drop:W1,W2@K1,K2.") from e
    if not all(0 <= w < num_workers for w in workers):
      raise ValueError(f"participation {spec!r}: workers must be in [0, {num_workers}).")
    for k in syncs:
      if 0 <= k < len(mask):
        mask[k, workers] = False
    return mask
  if kind == "random":
    rate = float(arg)
    if not 0 <= rate < 1:
      raise ValueError(f"participation {spec!r}: the drop rate must be in [0, 1).")
    mask = np.random.default_rng(seed).random(mask.shape) >= rate
    mask[~mask.any(axis=1), 0] = True
    return mask
  raise ValueError(f"participation {spec!r} is unknown; allowed: drop:W1,W2@K1,K2 or "
                   "random:RATE.")


def _outer(cfg):
  momentum = cfg.extra.get("outer_momentum", 0.9)
  return optax.sgd(cfg.extra.get("outer_lr", 0.7), momentum=momentum or None,
                   nesterov=bool(momentum))


def _common(cfg, syncs_per_period: int = 1, workers: str = "num_workers"):
  """(H, participation mask covering every sync of the run)."""
  h = cfg.extra.get("sync_every", 10)
  mask = participation_mask(cfg.extra.get("participation"), cfg.extra.get(workers, 1),
                            syncs_per_period * (cfg.steps // h + 1), cfg.seed)
  return h, mask


@builders.algorithm("local_sgd")
def _local_sgd(cfg, inner):
  h, mask = _common(cfg)
  return local.local_sgd(inner, h, cfg.axis_name, participation=mask)


@builders.algorithm("diloco")
def _diloco(cfg, inner):
  h, mask = _common(cfg)
  codec = _codec(cfg.extra.get("outer_codec"), None)
  return local.diloco(inner, _outer(cfg), h, cfg.axis_name, codec=codec,
                      memory="ef" if codec is not None and cfg.extra.get("outer_memory") else None,
                      participation=mask)


@builders.algorithm("streaming_diloco")
def _streaming(cfg, inner):
  fragments = cfg.extra.get("fragments", 2)
  h, mask = _common(cfg, fragments)
  compensation = cfg.extra.get("compensation")
  return local.streaming_diloco(inner, _outer(cfg), h, fragments, cfg.extra.get("overlap", 0),
                                cfg.extra.get("merge_alpha", 0.5), cfg.axis_name,
                                codec=_codec(cfg.extra.get("outer_codec"), "auto"),
                                participation=mask,
                                compensation=None if compensation in (None, "none")
                                else compensation,
                                dc_lambda=cfg.extra.get("dc_lambda", 1.0))


@builders.algorithm("sparseloco")
def _sparseloco(cfg, inner):
  h, mask = _common(cfg)
  bits = cfg.extra.get("sparse_bits", 2)
  return local.sparseloco(inner, h, cfg.extra.get("density", 0.02), bits or None,
                          cfg.axis_name, outer_lr=cfg.extra.get("outer_lr", 1.0),
                          participation=mask)


@builders.algorithm("dreamddp")
def _dreamddp(cfg, inner):
  h = cfg.extra.get("sync_every", 10)
  h, mask = _common(cfg, syncs_per_period=h)  # up to one group sync per step
  return local.dreamddp(inner, h, cfg.axis_name, participation=mask)


@builders.algorithm("scaffold")
def _scaffold(cfg, inner):
  h, mask = _common(cfg)
  return local.scaffold(inner, h, cfg.axis_name, participation=mask)


@builders.algorithm("hierarchical")
def _hierarchical(cfg, inner):
  slow, fast = cfg.extra.get("slow_axis"), cfg.extra.get("fast_axis")
  if slow is None or fast is None:
    raise ValueError("hierarchical needs a mesh with a slow and a fast axis, e.g. "
                     "--mesh=slow:2,fast:4.")
  h, mask = _common(cfg, workers="num_slow")
  return local.hierarchical(inner, h, fast, slow, worker_steps=cfg.extra.get("worker_steps"),
                            weighting=cfg.extra.get("weighting", "uniform"),
                            participation=mask)
