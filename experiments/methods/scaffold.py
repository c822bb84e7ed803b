"""SCAFFOLD: local steps corrected by control variates (`local.scaffold`)."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.scaffold, skip=("inner", "axis_name"),
                             types={"participation": str}, sync_every=10)


def build(settings, ctx):
  return toolkit.call(local.scaffold, settings, inner=ctx.inner, axis_name=ctx.axis_name,
                     participation=ctx.participation(settings.participation))


def period(settings) -> int:
  """The parameters and control variates are averaged every `sync_every` steps."""
  return settings.sync_every


failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed
