"""Factored Gossip DiLoCo (`local.factored_gossip_diloco`, arXiv 2606.22768): DiLoCo without
an all-reduce. Every round (H = `sync_every` inner steps) each worker mixes its outer
parameters with its `graph` neighbours' (non-blocking: that gossip can run during the inner
steps), adds its own outer step (Nesterov SGD, `outer_lr`, `outer_momentum`), and every
`blocking_every` rounds mixes the outer steps too (blocking)."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.factored_gossip_diloco, skip=toolkit.GOSSIP_SKIP,
                              sync_every=10, graph="ring", outer_lr=0.7, outer_momentum=0.9)


def build(settings, ctx):
  return toolkit.gossip_schedule(local.factored_gossip_diloco, settings, ctx)


period = toolkit.sync_period  # a round every `sync_every` inner steps
local_step = toolkit.inner_step  # the gradient and the inner step; the outer one once a round
failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed


def tuning() -> list:
  """The tuned ruleset's settings."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)] + [{"blocking_every": 2}]
