"""ACCO: estimate and real rounds over a ZeRO-1 sharded inner optimiser (`local.acco`); each
worker's loss is its mean over the micro-batches it reaches in a round."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.acco, skip=("inner", "axis_name"))


def build(settings, ctx):
  return toolkit.call(local.acco, settings, inner=ctx.inner, axis_name=ctx.axis_name)


def wrap_loss(settings, loss_fn, ctx):
  return local.micro_batch_loss(loss_fn, settings.micro_batches, ctx.axis_name)


def overlap_steps(settings) -> int:
  del settings
  return 1


def tuning() -> list:
  """The tuned ruleset's settings (experiments.compare --ruleset=tuned)."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)]
