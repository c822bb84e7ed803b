"""A multilayer perceptron classifier (`jaxcomm.models.MLP`) on a labelled dataset (digits),
data-parallel."""

import jax.numpy as jnp
import ml_collections

from ..toolkit import Task
from jaxcomm import data, models


def defaults():
  return ml_collections.ConfigDict(dict(hidden=(64,)))  # the hidden layers' widths


def check(s) -> None:
  if not all(isinstance(h, int) and h >= 1 for h in s.hidden):
    raise ValueError(f"config.model.hidden must be widths >= 1, got {s.hidden!r}.")


def labelled(ctx, name: str) -> data.ArrayDataset:
  """The labelled dataset of the run (mlp, nnx_mlp)."""
  ctx.data_parallel_only()
  c = ctx.config
  dataset = None if c.data.name.startswith("folder:") else ctx.dataset()
  if not isinstance(dataset, data.ArrayDataset):
    raise ValueError(f"config.model.name {name!r} needs a labelled dataset (digits), got "
                     f"config.data.name {c.data.name!r}.")
  return dataset


def build(s, ctx) -> Task:
  dataset = labelled(ctx, "mlp")
  model = models.MLP(hidden=tuple(s.hidden), num_classes=dataset.num_classes)
  params = ctx.init(model.init)(ctx.key, jnp.zeros((1, dataset.x.shape[1])))
  return Task(model=model, loss_fn=models.classifier_loss(model), has_aux=True,
              params=params, batches=ctx.batches)
