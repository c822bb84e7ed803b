"""Asynchronous SGD with a fixed delay, optionally delay-compensated (`local.stale`)."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.stale, skip=("inner", "axis_name"),
                             types={"compensation": str}, delay=1)


def build(settings, ctx):
  return toolkit.call(local.stale, settings, inner=ctx.inner, axis_name=ctx.axis_name)
