"""LQ-SGD: PowerSGD whose factors travel log-quantised (`sync.lq_sgd`)."""

import optax

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(sync.lq_sgd, skip=("axis_name", "key", "param_specs"),
                             types={"memory": str, "block": int}, rank=2)


def build(settings, ctx):
  return optax.chain(toolkit.call(sync.lq_sgd, settings, axis_name=ctx.axis_name,
                                 key=ctx.key, param_specs=ctx.param_specs), ctx.inner)
