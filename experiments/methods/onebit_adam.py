"""1-bit Adam (`sync.onebit_adam`): a complete optimiser, so config.optimizer gives only its
learning rate (config.optimizer.lr); the inner optimiser is not used."""

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(sync.onebit_adam, skip=("learning_rate", "axis_name"),
                             types={"block": int}, freeze_step=100)


def build(settings, ctx):
  return toolkit.call(sync.onebit_adam, settings, learning_rate=ctx.config.optimizer.lr,
                     axis_name=ctx.axis_name)
