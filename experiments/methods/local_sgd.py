"""Local SGD: H local steps per worker, then the parameters are averaged (`local.local_sgd`).

`participation` is a spec (experiments.specs.participation_mask): drop:W@K or random:RATE.
"""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.local_sgd, skip=("inner", "axis_name"),
                             types={"participation": str}, sync_every=10)


def build(settings, ctx):
  return toolkit.call(local.local_sgd, settings, inner=ctx.inner, axis_name=ctx.axis_name,
                     participation=ctx.participation(settings.participation))


def period(settings) -> int:
  """The parameters are averaged every `sync_every` local steps."""
  return settings.sync_every


failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed
