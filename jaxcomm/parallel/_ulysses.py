"""Ulysses sequence parallelism: trade the sequence shard for a head shard around attention."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxcomm import comm
from jaxcomm.parallel._attention import causal_attention


def attention_ulysses(q_block, k_block, v_block, axis_name: str | None, *,
                      attention_fn: Callable | None = None):
  """Causal attention over a sequence sharded on `axis_name`, by DeepSpeed-Ulysses.

  One all-to-all turns the sequence-sharded Q, K, V (stacked, so one collective) into
  head-sharded ones over the full sequence; each device runs ordinary attention on its
  H/W heads; a second all-to-all returns the output to sequence shards. Call inside
  `jax.shard_map` with `axis_name` manual (or with None: one device, no communication).

  Args:
    q_block: f32[B, T/W, H, Dh] this device's queries (contiguous block r of the sequence).
    k_block: f32[B, T/W, H, Dh] keys.
    v_block: f32[B, T/W, H, Dh] values.
    axis_name: the sequence mesh axis, or None.
    attention_fn: local attention on full sequences, `(q, k, v) -> out` on
      [B, T, H/W, Dh] (default `causal_attention`).

  Returns:
    f32[B, T/W, H, Dh]: this device's rows of the attention output. Wire bytes per device:
    see `attention_ulysses_bytes`.

  Raises:
    ValueError: if H is not divisible by the axis size.

  References:
    Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training of
    Extreme Long Sequence Transformer Models", arXiv 2309.14509.

  >>> import jax.numpy as jnp
  >>> q = jnp.ones((1, 4, 2, 8))
  >>> attention_ulysses(q, q, q, None).shape
  (1, 4, 2, 8)
  """
  if attention_fn is None:
    attention_fn = causal_attention
  for name, x in (("k_block", k_block), ("v_block", v_block)):
    if x.shape != q_block.shape:
      raise ValueError(f"{name} has shape {x.shape}; it must match q_block {q_block.shape}.")
  if axis_name is None:
    return attention_fn(q_block, k_block, v_block)
  w = comm.axis_size(axis_name)
  heads = q_block.shape[2]
  if heads % w:
    raise ValueError(f"num_heads ({heads}) must be divisible by the size of sequence axis "
                     f"{axis_name!r} ({w}) for Ulysses.")
  qkv_block = jnp.stack([q_block, k_block, v_block])  # [3, B, T/W, H, Dh]
  # Split heads across devices, concatenate the sequence blocks in device order.
  qkv, _ = comm.all_to_all(qkv_block, axis_name, split_axis=3, concat_axis=2)
  out = attention_fn(qkv[0], qkv[1], qkv[2])  # [B, T, H/W, Dh]
  out_block, _ = comm.all_to_all(out, axis_name, split_axis=1, concat_axis=2)
  return out_block


def attention_ulysses_bytes(block_shape, w: int, dtype=jnp.float32) -> dict:
  """Wire bytes one device sends in Ulysses attention, forward and backward.

  Forward: an all-to-all of the stacked Q, K, V block (3 blocks) and one of the output
  block, (W-1)/W of the local buffer each. The backward pass transposes both: the same
  bytes again. Linear in T at fixed W (the block is [B, T/W, H, Dh]).

  >>> attention_ulysses_bytes((1, 4, 2, 8), 2)
  {'forward': 512.0, 'backward': 512.0}
  """
  block = float(np.prod(block_shape)) * jnp.dtype(dtype).itemsize
  fwd = comm.all_to_all_bytes(3 * block, w) + comm.all_to_all_bytes(block, w)
  return {"forward": fwd, "backward": fwd}
