"""MuonBP (`sync.muonbp`, arXiv 2510.16981): Muon whose Newton-Schulz runs on each device's
block of the momentum on `period` - 1 of every `period` steps (at `block_learning_rate`, by default
`lr`) and on the whole matrix on the others (`strategy`, as `muon`). Every other setting is
`muon`'s."""

import inspect

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(
      sync.muon, skip=("learning_rate", "axis_name", "param_specs",
                       "muon_weight_dimension_numbers"),
      types={"adam_learning_rate": float, "block_learning_rate": float, "consistent_rms": float},
      lr=0.02, period=5, block_learning_rate=None)


def build(settings, ctx):
  toolkit.number_in(ctx.config, "method.lr", 0, low_open=True)
  muon = inspect.signature(sync.muon).parameters
  kwargs = {k: settings[k] for k in settings.keys() if k in muon and k != "learning_rate"}
  kwargs["ns_coeffs"] = tuple(settings.ns_coeffs)
  if settings.adam_learning_rate is None:
    kwargs["adam_learning_rate"] = ctx.config.optimizer.lr
  return sync.muonbp(settings.lr, settings.period, settings.block_learning_rate, **kwargs,
                     axis_name=ctx.axis_name, param_specs=ctx.param_specs)


def tuning() -> list:
  """The tuned ruleset's settings: the full steps' lr; the block steps follow it."""
  return [{"lr": lr} for lr in (0.01, 0.02, 0.04)]
