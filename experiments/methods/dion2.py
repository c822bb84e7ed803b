"""Dion2 (`sync.dion2`, arXiv 2512.16928): Muon on the fraction `fraction` of each matrix's
rows (or columns) with the largest L1 norms, the rest kept in an error-feedback accumulator;
data parallel over the replicas by the exact mean gradient (as `muon`). On a laid-out mesh
each matrix is orthogonalised by one owner and the all-to-alls carry only selected slices
(`selection`: "global", the top slices of the whole matrix, or "local", of each shard)."""

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(
      sync.dion2, skip=("learning_rate", "axis_name", "param_specs"),
      types={"adam_learning_rate": float, "consistent_rms": float}, lr=0.02)


def build(settings, ctx):
  toolkit.number_in(ctx.config, "method.lr", 0, low_open=True)
  adam_lr = settings.adam_learning_rate
  return toolkit.call(sync.dion2, settings, learning_rate=settings.lr,
                      adam_learning_rate=ctx.config.optimizer.lr if adam_lr is None else adam_lr,
                      ns_coeffs=tuple(settings.ns_coeffs), axis_name=ctx.axis_name,
                      param_specs=ctx.param_specs)


def tuning() -> list:
  """The tuned ruleset's settings: the matrices' lr around the authors' 0.02."""
  return [{"lr": lr} for lr in (0.01, 0.02, 0.04)]
