"""The NNX Transformer LM (`jaxcomm.models.NnxTransformerLM`, with dropout) on a text
dataset, data-parallel (`Trainer.init` splits the module)."""

import ml_collections

from .. import toolkit
from ..toolkit import Task
from . import lm
from jaxcomm import models

MUTABLE = ("per_worker", "mean")


def defaults():
  return ml_collections.ConfigDict(dict(
      d_model=64, num_layers=2, num_heads=4, d_ff=256, dropout=0.0,
      mutable="per_worker"))  # mutable variables: per_worker or mean over the data axes


def check(s) -> None:
  lm.check_sizes(s)
  check_dropout_and_mutable(s)


def check_dropout_and_mutable(s) -> None:
  toolkit.number_in({"model": s}, "model.dropout", 0, 1, high_open=True)
  toolkit.one_of({"model": s}, "model.mutable", MUTABLE)


def rngs(ctx):
  """The model's `nnx.Rngs`: parameters from the seed, dropout from the next one."""
  from flax import nnx  # lazy: config reads every model's defaults(); nnx only to build
  return nnx.Rngs(params=ctx.config.seed, dropout=ctx.config.seed + 1)


def build(s, ctx) -> Task:
  from flax import nnx  # lazy: config reads every model's defaults(); nnx only to build
  ctx.data_parallel_only()
  lm.text_only(ctx, "nnx_lm")

  def make():
    return models.NnxTransformerLM(d_model=s.d_model, num_layers=s.num_layers,
                                   num_heads=s.num_heads, d_ff=s.d_ff,
                                   max_len=ctx.config.data.seq_len, dropout=s.dropout,
                                   rngs=rngs(ctx))

  model = nnx.eval_shape(make) if ctx.abstract else make()
  return Task(model=model, loss_fn=models.nnx_lm_loss, has_aux=False, params=model,
              batches=ctx.batches, mutable=s.mutable)
