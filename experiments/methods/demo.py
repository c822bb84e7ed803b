"""DeMo (`sync.demo`): a complete optimiser (sign of the decoded DCT components), so
config.optimizer gives only its learning rate; weight decay is DeMo's own setting."""

from experiments import config
from jaxcomm import sync


def defaults():
  return config.from_factory(sync.demo, skip=("learning_rate", "axis_name"))


def build(settings, ctx):
  return config.call(sync.demo, settings, learning_rate=ctx.config.optimizer.lr,
                     axis_name=ctx.axis_name)
