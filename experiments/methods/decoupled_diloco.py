"""Decoupled DiLoCo (arXiv 2604.21428): learners that never wait, a syncer that merges each
fragment once a quorum has delivered it (`local.decoupled_diloco`), on the clock of
`sim.decoupled_schedule`. `speeds`: each learner's step time relative to the others (empty:
all equal); `quorum` (0: every learner), `grace_steps` and `latency_steps` in steps of the
fastest learner. With every learner in every quorum and equal speeds it is Streaming DiLoCo
with `overlap = latency_steps`; the outer optimiser is DiLoCo's (`outer_lr`,
`outer_momentum`)."""

import numpy as np

from .. import toolkit
from jaxcomm import local
from jaxcomm import sim


def defaults():
  return toolkit.from_factory(
      local.decoupled_diloco, skip=("inner", "outer", "schedule", "axis_name", "key"),
      types={"codec": str, "collective": str}, sync_every=10, quorum=0, grace_steps=0.0,
      latency_steps=0, speeds=(), outer_lr=0.7, outer_momentum=0.9)


def _schedule(settings, learners: int, steps: int) -> local.DecoupledSchedule:
  """The ticks of `steps` updates of `learners` learners (every learner takes `steps`
  steps at least: the slowest's time for them is the horizon)."""
  tree = {"method": settings}
  toolkit.int_at_least(tree, "method.sync_every", 1)
  toolkit.int_at_least(tree, "method.quorum", 0)
  toolkit.int_at_least(tree, "method.latency_steps", 0)
  toolkit.number_in(tree, "method.grace_steps", 0.0)
  try:
    speeds = np.asarray(settings.speeds or (1.0,) * learners, np.float64)
  except (TypeError, ValueError):
    speeds = np.zeros(0)
  if speeds.shape != (learners,) or not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
    raise ValueError(f"config.method.speeds must be {learners} step times > 0 (one per "
                     f"learner) or empty, got {settings.speeds!r}.")
  unit = float(speeds.min())
  return sim.decoupled_schedule(
      speeds, settings.fragments, settings.sync_every, float(steps) * speeds.max(),
      quorum=settings.quorum or None, grace_s=settings.grace_steps * unit,
      latency_s=settings.latency_steps * unit)


def build(settings, ctx):
  return toolkit.call(
      local.decoupled_diloco, settings, inner=ctx.inner,
      outer=toolkit.nesterov(settings.outer_lr, settings.outer_momentum),
      schedule=_schedule(settings, ctx.num_workers, ctx.config.steps),
      axis_name=ctx.axis_name, key=ctx.key, codec=ctx.codec(settings.codec))


def period(settings) -> int:
  """Each learner delivers every fragment once in `sync_every` of its steps."""
  return settings.sync_every


def overlap_steps(settings) -> int:
  """A merged fragment reaches the learners `latency_steps` steps after it is sent."""
  return settings.latency_steps


def local_step(settings) -> str:
  """As DiLoCo's: the gradient and the inner optimiser."""
  del settings
  return "inner"


def failure_semantics(settings) -> sim.Semantics:
  """Learners never wait: a failure loses the failed learner's work since its last delivery
  (one every sync_every / fragments steps); the others go on."""
  return sim.Semantics("decoupled", round_steps=max(1, settings.sync_every
                                                      // settings.fragments))
