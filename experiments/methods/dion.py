"""Dion (`sync.dion`, arXiv 2504.05295): data parallel by low-rank factors. Each replica keeps
its own momentum; only the factors P and R of every matrix cross the replicas, and the
update is one-device Dion on the mean gradient. `rank_fraction` (or `rank`) sets r per matrix
(1/4 by default); the matrices run at `lr`, the other leaves AdamW (or Lion) at
`scalar_learning_rate`, by default config.optimizer.lr. On a laid-out mesh P's rows and R's
columns are sharded like the matrix's, with small inner-axis sums for the QR and the norms."""

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(
      sync.dion, skip=("learning_rate", "axis_name", "param_specs", "key"),
      types={"rank": int, "rank_fraction": float, "scalar_learning_rate": float}, lr=0.02)


def build(settings, ctx):
  # `lr` is this module's name for the factory's learning_rate: checked here, by its name.
  toolkit.number_in(ctx.config, "method.lr", 0, low_open=True)
  scalar_lr = settings.scalar_learning_rate
  return toolkit.call(sync.dion, settings, learning_rate=settings.lr,
                      scalar_learning_rate=ctx.config.optimizer.lr if scalar_lr is None
                      else scalar_lr, scalar_betas=tuple(settings.scalar_betas),
                      axis_name=ctx.axis_name, param_specs=ctx.param_specs, key=ctx.key)


def tuning() -> list:
  """The tuned ruleset's settings (experiments.compare --ruleset=tuned): Dion's lr around the
  authors' 0.02."""
  return [{"lr": lr} for lr in (0.01, 0.02, 0.04)]
