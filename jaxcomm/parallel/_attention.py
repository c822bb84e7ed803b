"""Single-device causal softmax attention: the reference every sequence-parallel attention
(ring, Ulysses) is held against, and the local attention they run by default."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
