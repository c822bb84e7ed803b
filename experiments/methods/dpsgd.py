"""D-PSGD: gossip averaging with neighbours on a graph (`sync.dpsgd`); `graph` names one of
`sync.GRAPHS` (ring, torus, exponential, complete, one_peer_exponential)."""

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(sync.dpsgd, skip=("inner", "axis_name", "num_workers"),
                             graph="ring")


def build(settings, ctx):
  return toolkit.call(sync.dpsgd, settings, inner=ctx.inner,
                     graph=sync.gossip_graph(settings.graph, ctx.num_workers),
                     axis_name=ctx.axis_name)
