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


period = toolkit.sync_period  # a round every `sync_every` inner steps
local_step = toolkit.inner_step  # the gradient and the inner step; the outer one once a round
failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed


def tuning() -> list:
  """The tuned ruleset's settings: the inner lr, and the accelerated variant."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)] + [{"momentum": 0.5}]
