"""Flax NNX versions of the LM and the MLP, trained by the same Trainer as the linen ones.

Their parameters, as `nnx.to_pure_dict(nnx.state(model, nnx.Param))`, have the same names
and shapes as the linen models' `params["params"]` (the NNX LM declares its parameters
from the linen LM's tables and runs the same forward functions), so weights copy across
with `nnx.update(model, linen_params["params"])`. The linen LM stays: the parallel layouts
(tensor, sequence, FSDP), the pipeline and `param_axes` are built on it.

Dropout and BatchNorm are NNX's own (`nnx.Dropout`, `nnx.BatchNorm`); the Trainer reseeds
the dropout stream every step and worker and carries the BatchNorm statistics in
`TrainState.model_state` (see `jaxcomm.train.Trainer`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp  # noqa: F401 (the docstring examples use it)
from flax import nnx

from jaxcomm import _validate as v
from jaxcomm.models._mlp import classification_loss
from jaxcomm.models._transformer import _Param
from jaxcomm.models._transformer import block_forward
from jaxcomm.models._transformer import causal_attention
from jaxcomm.models._transformer import embed_forward
from jaxcomm.models._transformer import head_forward
from jaxcomm.models._transformer import lm_tables
from jaxcomm.models._transformer import next_token_loss


def _declare(table: Any, rngs: nnx.Rngs) -> Any:
  """nnx.Params initialised as the table says (a bare one for a table entry, else a dict)."""
  make = lambda e: nnx.Param(e.init(rngs.params(), e.shape))
  if isinstance(table, _Param):
    return make(table)
  return nnx.data(jax.tree.map(make, table, is_leaf=lambda e: isinstance(e, _Param)))


def _values(tree: Any) -> Any:
  """The arrays of a tree of nnx.Variables."""
  return jax.tree.map(lambda v: v.get_value(), tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


class NnxTransformerLM(nnx.Module):
  """The decoder-only byte LM of `TransformerLM` as an NNX module (no layout).

  Args:
    vocab_size, d_model, num_layers, num_heads, d_ff, max_len: as `TransformerLM`.
    dropout: rate of the dropout on each block's attention and MLP outputs (0: none).
    attention_fn: the attention kernel, as `TransformerLM`.
    rngs: `nnx.Rngs` with a `params` (or default) stream and, with dropout, a `dropout` one.

  >>> from flax import nnx
  >>> lm = NnxTransformerLM(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=16,
  ...                       rngs=nnx.Rngs(0))
  >>> lm(jnp.zeros((2, 16), jnp.int32)).shape
  (2, 16, 256)
  """

  def __init__(self, vocab_size: int = 256, d_model: int = 64, num_layers: int = 2,
               num_heads: int = 4, d_ff: int = 256, max_len: int = 128, *,
               dropout: float = 0.0, attention_fn: Callable = causal_attention,
               rngs: nnx.Rngs):
    if d_model % num_heads:
      raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads}).")
    v.number("dropout", dropout, low=0.0, high=1.0, high_open=True)
    embed, block, head = lm_tables(vocab_size, d_model, num_heads, d_ff, max_len)
    for name, table in {**embed, **head}.items():
      setattr(self, name, _declare(table, rngs))
    self.num_layers = num_layers
    for i in range(num_layers):  # named like the linen LM's blocks
      setattr(self, f"block{i}", _declare(block, rngs))
    self.attention_fn = attention_fn
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Logits f32[B, T, V] for tokens i32[B, T] (at `positions`, default 0..T-1)."""
    x = embed_forward({"embed": _values(self.embed), "pos": self.pos.get_value()}, tokens,
                      positions)
    for i in range(self.num_layers):
      x = block_forward(_values(getattr(self, f"block{i}")), x,
                        attention_fn=self.attention_fn, dropout=self.dropout)
    return head_forward({"ln_f": _values(self.ln_f), "head": _values(self.head)}, x)


class NnxMLP(nnx.Module):
  """`MLP` as an NNX module, optionally with BatchNorm and Dropout after each hidden layer.

  Hidden layer i is Dense_i -> (BatchNorm_i) -> ReLU -> (dropout); the head is the last
  Dense_i. Parameter names match the linen `MLP`'s (with BatchNorm, the hidden Dense
  layers have no bias: BatchNorm's own bias takes its place).

  >>> from flax import nnx
  >>> mlp = NnxMLP(64, hidden=(32,), num_classes=10, dropout=0.1, batch_norm=True,
  ...              rngs=nnx.Rngs(0))
  >>> mlp(jnp.zeros((2, 64))).shape
  (2, 10)
  """

  def __init__(self, in_features: int, hidden: Sequence[int] = (64,), num_classes: int = 10,
               *, dropout: float = 0.0, batch_norm: bool = False, rngs: nnx.Rngs):
    v.number("dropout", dropout, low=0.0, high=1.0, high_open=True)
    widths = [in_features, *hidden, num_classes]
    self.num_hidden = len(hidden)
    self.batch_norm = batch_norm
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
      norm = batch_norm and i < len(hidden)  # BatchNorm's bias replaces the layer's
      setattr(self, f"Dense_{i}", nnx.Linear(a, b, use_bias=not norm, rngs=rngs))
      if norm:
        setattr(self, f"BatchNorm_{i}", nnx.BatchNorm(b, rngs=rngs))
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(self.num_hidden):
      x = getattr(self, f"Dense_{i}")(x)
      if self.batch_norm:
        x = getattr(self, f"BatchNorm_{i}")(x)
      x = jax.nn.relu(x)
      if self.dropout is not None:
        x = self.dropout(x)
    return getattr(self, f"Dense_{self.num_hidden}")(x)


def nnx_lm_loss(model: nnx.Module, batch: dict) -> jax.Array:
  """Mean next-token cross-entropy of an NNX LM on `{'tokens': i32[B, T+1]}` (a Trainer loss).

  >>> from flax import nnx
  >>> lm = NnxTransformerLM(d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=8,
  ...                       rngs=nnx.Rngs(0))
  >>> bool(nnx_lm_loss(lm, {"tokens": jnp.zeros((2, 9), jnp.int32)}) > 0)
  True
  """
  return next_token_loss(model, batch)


def nnx_classifier_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
  """(mean cross-entropy, {'accuracy'}) of an NNX classifier on `{'x', 'y'}` (has_aux=True).

  >>> from flax import nnx
  >>> mlp = NnxMLP(4, hidden=(8,), num_classes=3, rngs=nnx.Rngs(0))
  >>> loss, aux = nnx_classifier_loss(mlp, {"x": jnp.ones((5, 4)), "y": jnp.zeros(5, jnp.int32)})
  >>> loss.shape, sorted(aux)
  ((), ['accuracy'])
  """
  return classification_loss(model(batch["x"]), batch["y"])
