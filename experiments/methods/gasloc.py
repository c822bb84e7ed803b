"""GASLoC (`local.gasloc`, arXiv 2606.11081): DiLoCo without an all-reduce. Every round each
worker takes its own outer step (Nesterov SGD, `outer_lr`, `outer_momentum`), then a gossip
step of size `gossip_step` towards its `graph` neighbours; `momentum` > 0 is the accelerated
variant (momentum on the post-step iterates)."""

from .. import toolkit
from jaxcomm import local, sync


def defaults():
  return toolkit.from_factory(
      local.gasloc, skip=("inner", "outer", "graph", "num_workers", "axis_name"),
      sync_every=10, graph="ring", outer_lr=0.7, outer_momentum=0.9)


def build(settings, ctx):
  graph = sync.gossip_graph(toolkit.one_of(ctx.config, "method.graph", sync.GRAPHS),
                            ctx.num_workers)
  return toolkit.call(local.gasloc, settings, inner=ctx.inner, graph=graph,
                      outer=toolkit.nesterov(settings.outer_lr, settings.outer_momentum),
                      axis_name=ctx.axis_name)


def local_step(settings) -> str:
  """A worker's step is the gradient and the inner optimiser (the outer step once a round)."""
  del settings
  return "inner"


def tuning() -> list:
  """The tuned ruleset's settings."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)] + [{"momentum": 0.5}]
