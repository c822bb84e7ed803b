"""SparseLoCo: H inner steps, then a sparse low-bit outer gradient with error feedback
(`local.sparseloco`)."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.sparseloco, skip=("inner", "axis_name"),
                             types={"participation": str}, sync_every=10)


def build(settings, ctx):
  return toolkit.call(local.sparseloco, settings, inner=ctx.inner, axis_name=ctx.axis_name,
                     participation=ctx.participation(settings.participation))


def period(settings) -> int:
  """An outer sync every `sync_every` inner steps."""
  return settings.sync_every


failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed
