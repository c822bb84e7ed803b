"""DiLoCo: H inner steps, then an outer Nesterov step on the averaged progress
(`local.diloco`). The outer optimiser is SGD with Nesterov momentum (`outer_lr`,
`outer_momentum`; the paper's 0.7 and 0.9); `codec` is the outer gradient's codec spec.
`eager=True` overlaps the outer all-reduce with the next inner phase (arXiv 2502.12996);
`worker_steps` / `weighting="tokens"` give replicas their own periods and token weights."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(
      local.diloco, skip=("inner", "outer", "axis_name", "key"),
      types={"codec": str, "memory": str, "collective": str, "participation": str,
             "worker_steps": tuple, "tokens_per_step": tuple},
      sync_every=10, outer_lr=0.7, outer_momentum=0.9)


def build(settings, ctx):
  return toolkit.call(local.diloco, settings, inner=ctx.inner,
                     outer=toolkit.nesterov(settings.outer_lr, settings.outer_momentum),
                     axis_name=ctx.axis_name, key=ctx.key, codec=ctx.codec(settings.codec),
                     participation=ctx.participation(settings.participation))


def period(settings) -> int:
  """An outer sync every `sync_every` inner steps."""
  return settings.sync_every


def overlap_steps(settings) -> int:
  """Eager updates use sync k's mean at sync k + 1: the all-reduce overlaps H inner steps."""
  return settings.sync_every if settings.eager else 0


def local_step(settings) -> str:
  """A worker's step is the gradient and the inner optimiser; the outer step is once per
  `sync_every` steps (its compute left out of the per-step figure)."""
  del settings
  return "inner"


def tuning() -> list:
  """The tuned ruleset's settings (experiments.compare --ruleset=tuned)."""
  return [{"optimizer.lr": lr} for lr in (1e-3, 3e-3, 1e-2)] + [{"outer_lr": 0.5}]


failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed
