"""Streaming DiLoCo: fragments synced in turn, overlapped with later inner steps
(`local.streaming_diloco`); outer optimiser as DiLoCo's (`outer_lr`, `outer_momentum`).
`eager=True` uses each fragment's mean at its next sync (arXiv 2502.12996), so its
all-reduce overlaps H inner steps instead of `overlap`."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(
      local.streaming_diloco, skip=("inner", "outer", "axis_name", "key"),
      types={"codec": str, "collective": str, "participation": str, "compensation": str},
      sync_every=10, outer_lr=0.7, outer_momentum=0.9)


def build(settings, ctx):
  return toolkit.call(
      local.streaming_diloco, settings, inner=ctx.inner,
      outer=toolkit.nesterov(settings.outer_lr, settings.outer_momentum),
      axis_name=ctx.axis_name, key=ctx.key, codec=ctx.codec(settings.codec),
      participation=ctx.participation(settings.participation, settings.fragments))


def period(settings) -> int:
  """Every fragment is sent once per `sync_every` inner steps."""
  return settings.sync_every


def overlap_steps(settings) -> int:
  """A fragment is merged `overlap` inner steps after it is sent; eager, its mean is used
  at its next sync, H inner steps later."""
  return settings.sync_every if settings.eager else settings.overlap


def local_step(settings) -> str:
  """As DiLoCo's: the gradient and the inner optimiser."""
  del settings
  return "inner"


def tuning() -> list:
  """The tuned ruleset's settings (experiments.compare --ruleset=tuned)."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)] + [{"outer_lr": 0.5}]


failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed
