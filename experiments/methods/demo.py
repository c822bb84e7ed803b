"""DeMo (`sync.demo`): a complete optimiser (sign of the decoded DCT components), so
config.optimizer gives only its learning rate; weight decay is DeMo's own setting."""

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(sync.demo, skip=("learning_rate", "axis_name"))


def build(settings, ctx):
  return toolkit.call(sync.demo, settings, learning_rate=ctx.config.optimizer.lr,
                     axis_name=ctx.axis_name)


def overlap_backward(settings) -> bool:
  """Each tensor's momentum, DCT and top-k are its own, so a bucket can go as soon as the
  backward pass has made it."""
  del settings
  return True


def tuning() -> list:
  """The tuned ruleset's settings (experiments.compare --ruleset=tuned): DeMo's update is
  a sign, so smaller rates than AdamW's."""
  return [{"optimizer.lr": lr} for lr in (3e-4, 1e-3, 3e-3)]
