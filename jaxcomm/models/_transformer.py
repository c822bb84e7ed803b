"""A small decoder-only transformer language model (pre-norm, learned positions)."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def causal_attention(q, k, v):
  """Softmax attention with a causal mask. q, k, v: f32[B, T, H, Dh] -> f32[B, T, H, Dh].

  Example:
    >>> import jax.numpy as jnp
    >>> q = jnp.ones((1, 4, 2, 8))
    >>> causal_attention(q, q, q).shape
    (1, 4, 2, 8)
  """
  t = q.shape[1]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  mask = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


class Block(nn.Module):
  """Pre-norm attention + MLP block. `attention_fn` is the swappable attention kernel."""
  d_model: int
  num_heads: int
  d_ff: int
  attention_fn: Callable = causal_attention

  @nn.compact
  def __call__(self, x):
    b, t, _ = x.shape
    dh = self.d_model // self.num_heads
    h = nn.LayerNorm(name="ln_attn")(x)
    qkv = nn.Dense(3 * self.d_model, name="qkv")(h).reshape(b, t, 3, self.num_heads, dh)
    att = self.attention_fn(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(b, t, -1)
    x = x + nn.Dense(self.d_model, name="proj")(att)
    h = nn.LayerNorm(name="ln_mlp")(x)
    h = nn.Dense(self.d_ff, name="fc_in")(h)
    return x + nn.Dense(self.d_model, name="fc_out")(nn.gelu(h))


class TransformerLM(nn.Module):
  """Decoder-only LM over a byte vocabulary.

  >>> import jax, jax.numpy as jnp
  >>> lm = TransformerLM(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=16)
  >>> params = lm.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  >>> lm.apply(params, jnp.zeros((2, 16), jnp.int32)).shape
  (2, 16, 256)
  """
  vocab_size: int = 256
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  d_ff: int = 256
  max_len: int = 128
  attention_fn: Callable = causal_attention

  def __post_init__(self):
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads "
                       f"({self.num_heads}).")
    super().__post_init__()

  @nn.compact
  def __call__(self, tokens, positions=None):
    """Logits f32[B, T, V] for tokens i32[B, T] at `positions` i32[B, T] (default 0..T-1).

    Positions are given when the tokens are one shard of a longer sequence.
    """
    _, t = tokens.shape
    x = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.d_model))
    x = x + (pos[:t] if positions is None else pos[positions])
    for i in range(self.num_layers):
      x = Block(self.d_model, self.num_heads, self.d_ff, self.attention_fn, name=f"block{i}")(x)
    x = nn.LayerNorm(name="ln_f")(x)
    return nn.Dense(self.vocab_size, name="head")(x)


def lm_loss(model: nn.Module):
  """`loss(params, batch) -> mean next-token cross-entropy` for `{'tokens': i32[B, T+1]}`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> lm = TransformerLM(d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=8)
    >>> params = lm.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    >>> loss = lm_loss(lm)(params, {"tokens": jnp.zeros((2, 9), jnp.int32)})
    >>> loss.shape, bool(loss > 0)
    ((), True)
  """

  def loss_fn(params, batch):
    tokens = batch["tokens"]
    logits = model.apply(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return loss_fn
