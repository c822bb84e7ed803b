"""DreamDDP: each step syncs one group of layers, every layer once per H steps
(`local.dreamddp`); each sync overlaps the next step."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.dreamddp, skip=("inner", "axis_name"),
                             types={"participation": str}, sync_every=10)


def build(settings, ctx):
  return toolkit.call(local.dreamddp, settings, inner=ctx.inner, axis_name=ctx.axis_name,
                     participation=ctx.participation(settings.participation,
                                                     settings.sync_every))


def overlap_steps(settings) -> int:
  del settings
  return 1
