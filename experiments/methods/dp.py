"""Exact data parallelism: every worker steps with the mean gradient (`sync.mean`).

  --config=experiments/configs/dp.py [--config.method.dtype=bfloat16]
"""

import optax

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(sync.mean, skip=("axis_name",), types={"dtype": str})


def build(settings, ctx):
  return optax.chain(toolkit.call(sync.mean, settings, axis_name=ctx.axis_name), ctx.inner)


def local_step(settings) -> str:
  """A worker's step is the gradient and the inner optimiser (the cast and the mean are
  communication)."""
  del settings
  return "inner"


def overlap_backward(settings) -> bool:
  """The all-reduce can start per bucket as the backward pass makes the gradients."""
  del settings
  return True


def tuning() -> list:
  """The tuned ruleset's settings (experiments.compare --ruleset=tuned)."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)]
