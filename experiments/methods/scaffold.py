"""SCAFFOLD: local steps corrected by control variates (`local.scaffold`)."""

from .. import toolkit
from jaxcomm import local
from jaxcomm import sim


def defaults():
  return toolkit.from_factory(local.scaffold, skip=("inner", "axis_name"),
                             types={"participation": str}, sync_every=10)


def build(settings, ctx):
  return toolkit.call(local.scaffold, settings, inner=ctx.inner, axis_name=ctx.axis_name,
                     participation=ctx.participation(settings.participation))


def period(settings) -> int:
  """The parameters and control variates are averaged every `sync_every` steps."""
  return settings.sync_every


def failure_semantics(settings) -> sim.Semantics:
  """Under failures, as `jaxcomm.elastic` runs it: a failed replica leaves the quorum until it
  is healed, and a failure costs every survivor the round in flight (its period)."""
  return sim.Semantics("elastic", round_steps=period(settings))
