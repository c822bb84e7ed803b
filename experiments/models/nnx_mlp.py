"""The NNX multilayer perceptron (`jaxcomm.models.NnxMLP`: dropout, BatchNorm) on a labelled
dataset, data-parallel; BatchNorm statistics kept per worker or averaged (`mutable`)."""

import ml_collections

from ..toolkit import Task
from . import mlp, nnx_lm
from jaxcomm import models


def defaults():
  return ml_collections.ConfigDict(dict(
      hidden=(64,), dropout=0.0, batch_norm=False,
      mutable="per_worker"))  # BatchNorm statistics: per_worker or mean over the data axes


def check(s) -> None:
  mlp.check(s)
  nnx_lm.check_dropout_and_mutable(s)


def build(s, ctx) -> Task:
  from flax import nnx  # lazy: config reads every model's defaults(); nnx only to build
  dataset = mlp.labelled(ctx, "nnx_mlp")

  def make():
    return models.NnxMLP(dataset.x.shape[1], hidden=tuple(s.hidden),
                         num_classes=dataset.num_classes, dropout=s.dropout,
                         batch_norm=s.batch_norm, rngs=nnx_lm.rngs(ctx))

  model = nnx.eval_shape(make) if ctx.abstract else make()
  return Task(model=model, loss_fn=models.nnx_classifier_loss, has_aux=True, params=model,
              batches=ctx.batches, mutable=s.mutable)
