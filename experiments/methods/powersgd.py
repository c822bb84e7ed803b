"""PowerSGD: rank-r approximations of the mean gradient (`sync.powersgd`)."""

import optax

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(sync.powersgd, skip=("axis_name", "key", "param_specs", "views"),
                             types={"memory": str}, rank=2)


def build(settings, ctx):
  return optax.chain(toolkit.call(sync.powersgd, settings, axis_name=ctx.axis_name,
                                 key=ctx.key, param_specs=ctx.param_specs), ctx.inner)


def overlap_backward(settings) -> bool:
  """Each matrix's P and Q products are its own (PyTorch's PowerSGD is a DDP communication
  hook, bucket by bucket)."""
  del settings
  return True


def tuning() -> list:
  """The tuned ruleset's settings (experiments.compare --ruleset=tuned)."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)]
