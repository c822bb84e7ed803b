"""CHOCO-SGD: gossip of compressed differences on a static graph (`sync.choco`); `codec` is a
codec spec (experiments.specs.parse_codec)."""

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(sync.choco, skip=("inner", "axis_name", "num_workers", "key"),
                             graph="ring", codec="cast:bfloat16")


def build(settings, ctx):
  graph = sync.gossip_graph(settings.graph, ctx.num_workers)
  if graph.period != 1:
    raise ValueError(f"graph {graph.name!r} is time-varying; choco needs a static one "
                     "(dpsgd takes it).")
  return toolkit.call(sync.choco, settings, inner=ctx.inner, graph=graph,
                     codec=ctx.codec(settings.codec), axis_name=ctx.axis_name, key=ctx.key)
