"""Gradient compression: codec x error memory x collective (`sync.compressed`).

  --config=experiments/configs/compressed.py --config.method.codec=uniform:bits=8
      --config.method.memory=ef --config.method.collective=two_phase

`codec` is a spec in the vocabulary of `jaxcomm.codecs` (experiments.specs.parse_codec).
"""

import optax

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(
      sync.compressed, skip=("axis_name", "key"),
      types={"memory": str, "collective": str, "server_memory": bool, "memory_dtype": str},
      codec="top_k:fraction=0.01")


def build(settings, ctx):
  return optax.chain(toolkit.call(sync.compressed, settings, codec=ctx.codec(settings.codec),
                                 axis_name=ctx.axis_name, key=ctx.key), ctx.inner)


def overlap_backward(settings) -> bool:
  """Each tensor is compressed and sent on its own, so a bucket can go as soon as the
  backward pass has made it (as a DDP communication hook does)."""
  del settings
  return True


def tuning() -> list:
  """The tuned ruleset's settings (experiments.compare --ruleset=tuned)."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)]
