"""MuLoCo (`local.muloco`, arXiv 2505.23725): DiLoCo whose workers run Muon (`sync.muon`, at
`lr`; the sharded strategy `strategy` inside a replica), H inner steps, then an outer
Nesterov step (`outer_lr`, `outer_momentum`) on the outer gradient quantised to `bits` with
optional error feedback (`memory="ef"`)."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(
      local.muloco, skip=("learning_rate", "axis_name", "param_specs", "outer", "key"),
      types={"bits": int, "memory": str, "collective": str, "participation": str},
      lr=0.02, outer_lr=0.7, outer_momentum=0.9)


def build(settings, ctx):
  # `lr` is this module's name for the factory's learning_rate: checked here, by its name.
  toolkit.number_in(ctx.config, "method.lr", 0, low_open=True)
  return toolkit.call(local.muloco, settings, learning_rate=settings.lr,
                     outer=toolkit.nesterov(settings.outer_lr, settings.outer_momentum),
                     axis_name=ctx.axis_name, param_specs=ctx.param_specs, key=ctx.key,
                     participation=ctx.participation(settings.participation))


def period(settings) -> int:
  """An outer sync every `sync_every` inner steps."""
  return settings.sync_every


failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed
