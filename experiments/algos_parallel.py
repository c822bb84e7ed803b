"""ZeRO as `--algo` choices, and the optimiser for a model laid out on a mesh (`--mesh`).

  python -m experiments.train --algo=zero1 --zero_codec=uniform --bits=8 --zero_memory=ef
  python -m experiments.train --mesh=data=2,fsdp=2,tensor=2
"""

from __future__ import annotations

import math

import jax
import optax

from experiments import algos_compression
from experiments import builders
from experiments import layouts_sequence
from jaxcomm import parallel


LAYOUT_AXES = ("data", "fsdp", "tensor")


def parse_train_mesh(text: str, num_devices: int) -> dict:
  """train.py's --mesh: '' -> {'data': num_devices}; data/fsdp/tensor axes (this module) or
  sequence/pipeline axes (experiments/layouts_sequence.py, which checks those)."""
  if not text:
    return {"data": num_devices}
  shape = parallel.parse_mesh(text)
  if {"sequence", "pipeline"} & set(shape):
    return layouts_sequence.parse_mesh(text, num_devices)
  unknown = [a for a in shape if a not in LAYOUT_AXES]
  if unknown:
    raise ValueError(f"--mesh axes {unknown} are unknown; allowed: {', '.join(LAYOUT_AXES)} "
                     "(or data with sequence or pipeline).")
  if math.prod(shape.values()) != num_devices:
    raise ValueError(f"--mesh {shape} multiplies to {math.prod(shape.values())}, but there are "
                     f"{num_devices} devices.")
  return shape


def zero_codec(cfg: builders.Config):
  """The codec of ZeRO's reduce-scatter: --zero_codec (a name of algos_compression.CODECS,
  with --bits, --chunk, --fraction) or none."""
  name = cfg.extra.get("zero_codec") or "none"
  if name == "none":
    return None
  return algos_compression.make_codec(name, cfg.extra.get("fraction", 0.01),
                                      cfg.extra.get("bits", 4), cfg.extra.get("chunk"))


def _zero(stage):
  def build(cfg: builders.Config, inner: optax.GradientTransformation):
    codec = zero_codec(cfg)
    memory = cfg.extra.get("zero_memory")
    key = jax.random.key(cfg.seed) if codec is not None and codec.stochastic else None
    return parallel.zero(inner, stage=stage, axis_name=cfg.axis_name, codec=codec,
                         memory=None if memory in (None, "none") else memory, key=key)
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
