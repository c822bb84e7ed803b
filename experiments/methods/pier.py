"""Pier (`local.pier`, arXiv 2511.17849): DiLoCo whose outer Nesterov momentum warms up from
`initial` to `momentum` over the first `warmup` outer steps and, with `decay_from` and
`total` (outer steps), decays linearly to `final` (`local.pier_momentum`)."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(
      local.pier, skip=("inner", "axis_name"), types={"decay_from": int, "total": int},
      sync_every=10, warmup=10, initial=0.0, decay_from=None, total=None, final=0.0)


def build(settings, ctx):
  # `momentum` is the schedule's peak here: checked by its name.
  toolkit.number_in(ctx.config, "method.momentum", 0, 1, high_open=True)
  schedule = local.pier_momentum(settings.momentum, settings.warmup, initial=settings.initial,
                                 decay_from=settings.decay_from, total=settings.total,
                                 final=settings.final)
  return toolkit.call(local.pier, settings, inner=ctx.inner, momentum=schedule,
                      axis_name=ctx.axis_name)


period = toolkit.sync_period  # a round every `sync_every` inner steps
local_step = toolkit.inner_step  # the gradient and the inner step; the outer one once a round
failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed


def tuning() -> list:
  """The tuned ruleset's settings."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)] + [{"outer_lr": 0.5}]
