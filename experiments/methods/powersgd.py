"""PowerSGD: rank-r approximations of the mean gradient (`sync.powersgd`)."""

import optax

from experiments import config
from jaxcomm import sync


def defaults():
  return config.from_factory(sync.powersgd, skip=("axis_name", "key", "param_specs", "views"),
                             types={"memory": str}, rank=2)


def build(settings, ctx):
  return optax.chain(config.call(sync.powersgd, settings, axis_name=ctx.axis_name,
                                 key=ctx.key, param_specs=ctx.param_specs), ctx.inner)
