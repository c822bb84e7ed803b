"""Muon, data parallel (`sync.muon`): the exact mean gradient, then Muon's orthogonalised
momentum on every matrix (at `lr`) and AdamW on the other leaves (at `adam_learning_rate`,
by default config.optimizer.lr). On a laid-out mesh (replica x fsdp x tensor) each matrix
is orthogonalised whole: `strategy` "owner" (all-to-all to one owner per matrix and back)
or "gram" (Gram all-reduces per Newton-Schulz iteration)."""

from .. import toolkit
from jaxcomm import sync


def defaults():
  return toolkit.from_factory(
      sync.muon, skip=("learning_rate", "axis_name", "param_specs",
                       "muon_weight_dimension_numbers"),
      types={"adam_learning_rate": float}, lr=0.02)


def build(settings, ctx):
  # `lr` is this module's name for the factory's learning_rate: checked here, by its name.
  toolkit.number_in(ctx.config, "method.lr", 0, low_open=True)
  adam_lr = settings.adam_learning_rate
  return toolkit.call(sync.muon, settings, learning_rate=settings.lr,
                     adam_learning_rate=ctx.config.optimizer.lr if adam_lr is None else adam_lr,
                     axis_name=ctx.axis_name, param_specs=ctx.param_specs)
