"""NoLoCo (`local.noloco`, arXiv 2506.10911): H inner steps, then each worker averages its
outer step with one random partner (one ppermute of |θ|); no all-reduce."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.noloco, skip=("inner", "axis_name"),
                             types={"participation": str}, sync_every=10)


def build(settings, ctx):
  return toolkit.call(local.noloco, settings, inner=ctx.inner, axis_name=ctx.axis_name,
                     participation=ctx.participation(settings.participation))


def period(settings) -> int:
  """Each worker averages with a partner every `sync_every` inner steps."""
  return settings.sync_every


failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed
