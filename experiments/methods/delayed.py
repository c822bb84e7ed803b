"""One-step delayed update: step t's mean gradient is applied at t + 1 (`local.delayed`), so
the all-reduce overlaps the next step."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.delayed, skip=("inner", "axis_name"))


def build(settings, ctx):
  return toolkit.call(local.delayed, settings, inner=ctx.inner, axis_name=ctx.axis_name)


def overlap_steps(settings) -> int:
  del settings
  return 1
