"""Ring attention: blockwise causal softmax attention with K/V blocks rotating around a ring.

Each device of the sequence axis holds one block of queries, keys and values. The K/V blocks
travel around the ring by ppermute (W-1 shifts); every device folds each visiting block into
an online softmax (running max, running sum, unnormalised output), so the full T x T score
matrix never exists anywhere. The backward pass (a custom VJP, as in the paper) recomputes
the scores block by block from the saved log-sum-exp, rotating K/V again together with the
dK/dV accumulators, which take one more shift to return home.

Causality skips work: a device computes nothing for a block that lies entirely in its
future. With contiguous blocks that leaves device 0 almost idle and device W-1 doing W
blocks; with `zigzag=True` device i holds chunks i and 2W-1-i of 2W equal chunks, and every
off-diagonal step costs exactly half a block on every device (load balanced).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import comm
from jaxcomm.parallel._attention import causal_attention

_NEG = -1e30  # finite "minus infinity": exp(_NEG - _NEG) stays finite in fully masked rows

# Branches of one ring step, decided by where the visiting block sits relative to ours.
_DIAG, _PAST, _FUTURE = 0, 1, 2


def zigzag_order(seq_len: int, w: int) -> np.ndarray:
  """Permutation of `range(seq_len)` that puts chunks (i, 2w-1-i) of 2w on device i.

  `x[:, zigzag_order(T, W)]` sharded contiguously over W devices is the zig-zag layout
  `attention_ring(..., zigzag=True)` expects; `np.argsort` of it undoes it.

  >>> zigzag_order(8, 2).tolist()
  [0, 1, 6, 7, 2, 3, 4, 5]
  """
  if seq_len % (2 * w):
    raise ValueError(f"seq_len ({seq_len}) must be divisible by 2 * the sequence axis size "
                     f"({2 * w}) for the zig-zag layout.")
  chunks = np.arange(seq_len).reshape(2 * w, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * w - 1 - i]])
                         for i in range(w)])


def _block_positions(index, w: int, c: int, zigzag: bool):
  """Global positions i32[c] of the block held by device `index` (traced)."""
  if not zigzag:
    return index * c + jnp.arange(c)
  half = c // 2
  return jnp.concatenate([index * half + jnp.arange(half),
                          (2 * w - 1 - index) * half + jnp.arange(half)])


def _branch(me, src):
  return jnp.where(src == me, _DIAG, jnp.where(src < me, _PAST, _FUTURE))


# ------------------------------------------------------------------------------ forward
def _fold(carry, q, k, v, q_pos, k_pos):
  """Folds one K/V block into the online-softmax state of the queries `q`."""
  o, m, l = carry  # o: f32[B, Tq, H, Dh] unnormalised; m, l: f32[B, H, Tq]
  scale = 1.0 / np.sqrt(q.shape[-1])
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
  mask = q_pos[:, None] >= k_pos[None, :]
  m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _NEG), axis=-1))
  p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
  corr = jnp.exp(m - m_new)
  l = l * corr + jnp.sum(p, axis=-1)
  o = o * jnp.swapaxes(corr, 1, 2)[..., None] + jnp.einsum("bhqk,bkhd->bqhd", p,
                                                           v.astype(jnp.float32))
  return o, m_new, l


def _split_rows(carry, half):
  first = jax.tree.map(lambda x, ax: lax.slice_in_dim(x, 0, half, axis=ax), carry, (1, 2, 2))
  second = jax.tree.map(lambda x, ax: lax.slice_in_dim(x, half, None, axis=ax), carry,
                        (1, 2, 2))
  return first, second


def _join_rows(first, second):
  return jax.tree.map(lambda a, b, ax: jnp.concatenate([a, b], axis=ax), first, second,
                      (1, 2, 2))


def _fold_step(carry, q, k, v, q_pos, k_pos, branch, zigzag):
  """One ring step of the forward pass, skipping what causality masks out."""
  c = q.shape[1]
  half = c // 2

  def diag(carry):
    return _fold(carry, q, k, v, q_pos, k_pos)

  def past(carry):
    if not zigzag:  # the whole visiting block precedes ours: no mask needed
      return _fold(carry, q, k, v, q_pos, k_pos)
    # Both our chunks see only the visitor's early chunk.
    return _fold(carry, q, k[:, :half], v[:, :half], q_pos, k_pos[:half])

  def future(carry):
    if not zigzag:  # entirely in our future: nothing to do
      return carry
    # Only our late chunk sees the visitor, and sees all of it.
    first, second = _split_rows(carry, half)
    second = _fold(second, q[:, half:], k, v, q_pos[half:], k_pos)
    return _join_rows(first, second)

  return lax.switch(branch, (diag, past, future), carry)


def _ring_forward(q, k, v, axis_name, zigzag):
  w = comm.axis_size(axis_name)
  me = lax.axis_index(axis_name)
  b, c, h, dh = q.shape
  q_pos = _block_positions(me, w, c, zigzag)
  carry = comm.varying((jnp.zeros((b, c, h, dh), jnp.float32),
                        jnp.full((b, h, c), _NEG, jnp.float32),
                        jnp.zeros((b, h, c), jnp.float32)), tuple(comm.varying_axes(q)))

  def step(j, carry, kv):
    src = (me - j) % w
    k_pos = _block_positions(src, w, c, zigzag)
    return _fold_step(carry, q, kv[0], kv[1], q_pos, k_pos, _branch(me, src), zigzag)

  def body(state, j):
    carry, kv = state
    carry = step(j, carry, kv)
    kv, _ = comm.shift(kv, axis_name, 1)  # device i receives the block of device i-1
    return (carry, kv), None

  (carry, kv), _ = lax.scan(body, (carry, (k, v)), jnp.arange(w - 1))
  o, m, l = step(w - 1, carry, kv)
  out = (o / jnp.swapaxes(l, 1, 2)[..., None]).astype(q.dtype)
  lse = m + jnp.log(l)  # f32[B, H, Tq]
  return out, lse


# ----------------------------------------------------------------------------- backward
def _grads(q, k, v, do, lse, delta, q_pos, k_pos):
  """Gradients of one (query block, K/V block) pair, FlashAttention-2 style."""
  scale = 1.0 / np.sqrt(q.shape[-1])
  f32 = lambda x: x.astype(jnp.float32)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
  mask = q_pos[:, None] >= k_pos[None, :]
  p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
  dv = jnp.einsum("bhqk,bqhd->bkhd", p, f32(do))
  dp = jnp.einsum("bqhd,bkhd->bhqk", f32(do), f32(v))
  ds = p * (dp - delta[..., None]) * scale
  dq = jnp.einsum("bhqk,bkhd->bqhd", ds, f32(k))
  dk = jnp.einsum("bhqk,bqhd->bkhd", ds, f32(q))
  return dq, dk, dv


def _grad_step(q, k, v, do, lse, delta, q_pos, k_pos, branch, zigzag):
  """dq, dk, dv (f32, full block shapes) of one ring step, skipping masked-out work."""
  c = q.shape[1]
  half = c // 2

  def diag():
    return _grads(q, k, v, do, lse, delta, q_pos, k_pos)

  def past():
    if not zigzag:
      return _grads(q, k, v, do, lse, delta, q_pos, k_pos)
    dq, dk, dv = _grads(q, k[:, :half], v[:, :half], do, lse, delta, q_pos, k_pos[:half])
    pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)
    return dq, pad(dk), pad(dv)

  def future():
    zeros = jnp.zeros(q.shape, jnp.float32)
    if not zigzag:
      return zeros, zeros, zeros
    dq, dk, dv = _grads(q[:, half:], k, v, do[:, half:], lse[..., half:], delta[..., half:],
                        q_pos[half:], k_pos)
    return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

  axes = tuple(comm.varying_axes(q))
  # Branches must agree on varying axes: zeros are born invariant.
  return lax.switch(branch, tuple(lambda f=f: comm.varying(f(), axes)
                                  for f in (diag, past, future)))


def _ring_backward(axis_name, zigzag, res, d_out):
  q, k, v, out, lse = res
  w = comm.axis_size(axis_name)
  me = lax.axis_index(axis_name)
  c = q.shape[1]
  q_pos = _block_positions(me, w, c, zigzag)
  delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
  axes = tuple(comm.varying_axes(q))
  zeros = comm.varying(jnp.zeros(q.shape, jnp.float32), axes)

  def step(j, kv):
    src = (me - j) % w
    k_pos = _block_positions(src, w, c, zigzag)
    return _grad_step(q, kv[0], kv[1], d_out, lse, delta, q_pos, k_pos, _branch(me, src),
                      zigzag)

  def body(state, j):
    dq, kv, dkv = state
    dq_j, dk_j, dv_j = step(j, kv)
    dkv = (dkv[0] + dk_j, dkv[1] + dv_j)
    # K/V and their gradient accumulators travel together.
    (kv, dkv), _ = comm.shift((kv, dkv), axis_name, 1)
    return (dq + dq_j, kv, dkv), None

  (dq, kv, dkv), _ = lax.scan(body, (zeros, (k, v), (zeros, zeros)), jnp.arange(w - 1))
  dq_j, dk_j, dv_j = step(w - 1, kv)
  # One last shift brings every dK/dV accumulator back to the device that owns the block.
  (dk, dv), _ = comm.shift((dkv[0] + dk_j, dkv[1] + dv_j), axis_name, 1)
  return (dq + dq_j).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ring(q, k, v, axis_name, zigzag):
  return _ring_forward(q, k, v, axis_name, zigzag)[0]


def _ring_fwd(q, k, v, axis_name, zigzag):
  out, lse = _ring_forward(q, k, v, axis_name, zigzag)
  return out, (q, k, v, out, lse)


_ring.defvjp(_ring_fwd, _ring_backward)


def attention_ring(q_block, k_block, v_block, axis_name: str | None, *, zigzag: bool = False):
  """Causal softmax attention over a sequence sharded on `axis_name`, by ring attention.

  Call inside `jax.shard_map` with `axis_name` manual; with `axis_name=None` it is plain
  causal attention on one device. Plugs into `TransformerLM(attention_fn=...)` as
  `functools.partial(attention_ring, axis_name="sequence")`.

  Args:
    q_block: f32[B, T/W, H, Dh] this device's queries (contiguous block r of the sequence,
      or chunks (r, 2W-1-r) of 2W with `zigzag`; see `zigzag_order`).
    k_block: f32[B, T/W, H, Dh] keys, same layout.
    v_block: f32[B, T/W, H, Dh] values, same layout.
    axis_name: the sequence mesh axis (one axis name), or None.
    zigzag: whether blocks are in the zig-zag layout (balanced causal work).

  Returns:
    f32[B, T/W, H, Dh]: this device's rows of softmax(QK^T/sqrt(Dh) + causal mask) V.
    Wire bytes per device: see `attention_ring_bytes`.

  References:
    Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
    Context", arXiv 2310.01889; the zig-zag layout is the load balancing of Llama 3
    context parallelism (arXiv 2407.21783) and of zhuzilin/ring-flash-attention.

  >>> import jax.numpy as jnp
  >>> q = jnp.ones((1, 4, 2, 8))
  >>> attention_ring(q, q, q, None).shape
  (1, 4, 2, 8)
  """
  for name, x in (("k_block", k_block), ("v_block", v_block)):
    if x.shape != q_block.shape:
      raise ValueError(f"{name} has shape {x.shape}; it must match q_block {q_block.shape}.")
  if axis_name is None:
    return causal_attention(q_block, k_block, v_block)
  if not isinstance(axis_name, str):
    raise ValueError(f"axis_name must be one mesh axis name (a ring), got {axis_name!r}.")
  if zigzag and q_block.shape[1] % 2:
    raise ValueError(f"zigzag needs an even block length, got T/W = {q_block.shape[1]}.")
  return _ring(q_block, k_block, v_block, axis_name, zigzag)


def attention_ring_bytes(block_shape, w: int, dtype=jnp.float32) -> dict:
  """Wire bytes one device sends in ring attention, forward and backward.

  Forward: K and V blocks shift W-1 times. Backward: K and V shift W-1 times again and the
  f32 dK/dV accumulators W times (the last shift returns them home). Both grow linearly
  with the sequence length (the block is [B, T/W, H, Dh], and W blocks travel).

  >>> attention_ring_bytes((1, 4, 2, 8), 4)
  {'forward': 1536.0, 'backward': 3584.0}
  """
  block = float(np.prod(block_shape))
  kv = 2 * block * jnp.dtype(dtype).itemsize
  return {"forward": (w - 1) * kv, "backward": (w - 1) * kv + w * 2 * block * 4}
