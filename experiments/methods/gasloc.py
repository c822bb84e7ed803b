"""GASLoC (`local.gasloc`, arXiv 2606.11081): DiLoCo without an all-reduce. Every round each
worker takes its own outer step (Nesterov SGD, `outer_lr`, `outer_momentum`), then a gossip
step of size `gossip_step` towards its `graph` neighbours; `momentum` > 0 is the accelerated
variant (momentum on the post-step iterates)."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.gasloc, skip=toolkit.GOSSIP_SKIP, sync_every=10,
                              graph="ring", outer_lr=0.7, outer_momentum=0.9)


def build(settings, ctx):
  return toolkit.gossip_schedule(local.gasloc, settings, ctx)



def period(settings) -> int:
  """A round (the outer step and one gossip) every `sync_every` inner steps."""
  return settings.sync_every

def local_step(settings) -> str:
  """The outer step runs once a round: a worker's step is the gradient and the inner step."""
  del settings
  return "inner"


def tuning() -> list:
  """The tuned ruleset's settings: the inner lr, and the accelerated variant."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)] + [{"momentum": 0.5}]
