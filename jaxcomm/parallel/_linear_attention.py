"""Causal linear attention and its sequence-parallel forms: LASP-2, All-Scan, the LASP ring.

With state M_t = λ M_{t-1} + k_t^T v_t, causal linear attention is o_t = q_t M_t, i.e.
O = ((Q K^T) ⊙ D) V with D_ts = λ^(t-s) for s <= t and 0 above the diagonal (λ = 1: no
decay). Split the sequence into W chunks of length C, one per device. Device r computes
its intra-chunk part locally and needs one thing from the others: the prefix state

    P_r = Σ_{u<r} λ^(C (r-1-u)) S_u,   S_u = Σ_j λ^(C-1-j) k_j^T v_j  (chunk u's state),

after which o_t = (intra) + λ^(t+1) q_t P_r for local position t. The three forms differ only
in how P_r is obtained:

* LASP-2: all-gather every S_u (one collective), form P_r locally.
* All-Scan (ZeCO): a pipelined ppermute chain P_{r+1} = λ^C P_r + S_r, the state split into
  pieces so device r forwards piece p while device r-1 works on piece p+1.
* LASP ring: the same chain without pipelining (one piece), the original LASP.

All send a fixed number of states: traffic does not depend on the sequence length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import comm


def _log_decay(decay, heads: int):
  """log λ as f32[H] (zeros without decay), validating the values."""
  if decay is None:
    return jnp.zeros((heads,), jnp.float32)
  arr = np.asarray(decay, np.float32) if not isinstance(decay, jax.Array) else decay
  if isinstance(arr, np.ndarray):
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != heads):
      raise ValueError(f"decay must be a scalar or have shape [num_heads]=[{heads}], got "
                       f"shape {arr.shape}.")
    if np.any(arr <= 0) or np.any(arr > 1):
      raise ValueError(f"decay must lie in (0, 1], got {arr}.")
  return jnp.broadcast_to(jnp.log(jnp.asarray(arr, jnp.float32)), (heads,))


def _intra(q, k, v, log_decay):
  """((Q K^T) ⊙ D) V on one chunk: f32[B, C, H, Dh]."""
  c = q.shape[1]
  t = jnp.arange(c)
  gap = (t[:, None] - t[None, :]).astype(jnp.float32)  # t - s
  weights = jnp.where(gap >= 0, jnp.exp(gap[None] * log_decay[:, None, None]), 0.0)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * weights  # [B, H, C, C]
  return jnp.einsum("bhqk,bkhe->bqhe", scores, v)


def linear_attention(q, k, v, *, decay=None):
  """Causal linear attention on one device, O = ((Q K^T) ⊙ D) V (the reference).

  Args:
    q: f32[B, T, H, Dk] queries (apply any feature map before).
    k: f32[B, T, H, Dk] keys.
    v: f32[B, T, H, Dv] values.
    decay: None, a scalar or f32[H] in (0, 1]: the state decays by λ per position.

  Returns:
    f32[B, T, H, Dv].

  References:
    Katharopoulos et al., "Transformers are RNNs", arXiv 2006.16236; decay as in
    Qin et al., "Lightning Attention-2", arXiv 2401.04658.

  >>> import jax.numpy as jnp
  >>> x = jnp.ones((1, 3, 1, 1))
  >>> linear_attention(x, x, x)[0, :, 0, 0].tolist()
  [1.0, 2.0, 3.0]
  """
  return _intra(q, k, v, _log_decay(decay, q.shape[2]))


def _chunk_state(k, v, log_decay):
  """S = Σ_j λ^(C-1-j) k_j^T v_j: f32[B, H, Dk, Dv]."""
  c = k.shape[1]
  w = jnp.exp((c - 1 - jnp.arange(c, dtype=jnp.float32))[:, None] * log_decay)  # [C, H]
  return jnp.einsum("bkhd,bkhe->bhde", k * w[None, :, :, None], v)


def _with_prefix(q, k, v, prefix, log_decay):
  """Local output given the prefix state P_r: intra-chunk part + λ^(t+1) q_t P_r."""
  c = q.shape[1]
  w = jnp.exp((jnp.arange(c, dtype=jnp.float32) + 1)[:, None] * log_decay)  # [C, H]
  inter = jnp.einsum("bqhd,bhde->bqhe", q * w[None, :, :, None], prefix)
  return _intra(q, k, v, log_decay) + inter


def _check_blocks(q_block, k_block, v_block):
  b, c, h, _ = q_block.shape
  if k_block.shape != q_block.shape:
    raise ValueError(f"k_block has shape {k_block.shape}; it must match q_block "
                     f"{q_block.shape}.")
  if v_block.shape[:3] != (b, c, h):
    raise ValueError(f"v_block has shape {v_block.shape}; its first three dimensions must "
                     f"match q_block {q_block.shape}.")


def linear_attention_lasp2(q_block, k_block, v_block, axis_name: str | None, *, decay=None):
  """Causal linear attention over a sequence sharded on `axis_name`, by LASP-2.

  Every device all-gathers the W chunk states S_u (one collective of B·H·Dk·Dv per device,
  whatever the sequence length) and forms its own prefix locally. Under `jax.grad` the
  gather's transpose is a reduce-scatter of the same size.

  Args:
    q_block: f32[B, T/W, H, Dk] this device's queries (contiguous block r).
    k_block: f32[B, T/W, H, Dk] keys.
    v_block: f32[B, T/W, H, Dv] values.
    axis_name: the sequence mesh axis, or None (one device).
    decay: None, a scalar or f32[H] in (0, 1].

  Returns:
    f32[B, T/W, H, Dv]. Wire bytes: `linear_attention_lasp2_bytes`.

  References:
    Sun et al., "LASP-2: Rethinking Sequence Parallelism for Linear Attention and Its
    Hybrid", arXiv 2502.07563.

  >>> import jax.numpy as jnp
  >>> x = jnp.ones((1, 3, 1, 1))
  >>> linear_attention_lasp2(x, x, x, None)[0, :, 0, 0].tolist()
  [1.0, 2.0, 3.0]
  """
  _check_blocks(q_block, k_block, v_block)
  log_decay = _log_decay(decay, q_block.shape[2])
  if axis_name is None:
    return _intra(q_block, k_block, v_block, log_decay)
  w = comm.axis_size(axis_name)
  r = lax.axis_index(axis_name)
  c = q_block.shape[1]
  state = _chunk_state(k_block, v_block, log_decay)
  states, _ = comm.all_gather(state, axis_name, invariant=False)  # [W, B, H, Dk, Dv]
  u = jnp.arange(w)
  hops = (r - 1 - u).astype(jnp.float32)[:, None]  # [W, 1]
  weights = jnp.where(u[:, None] < r, jnp.exp(hops * c * log_decay[None]), 0.0)  # [W, H]
  prefix = jnp.einsum("uh,ubhde->bhde", weights, states)
  return _with_prefix(q_block, k_block, v_block, prefix, log_decay)


def _prefix_chain(state, chunk_decay, axis_name, num_pieces: int):
  """Exclusive prefix P_r by a pipelined ppermute chain r -> r+1 (All-Scan; K=1: LASP).

  The flat state is cut into `num_pieces` pieces. At step t device r handles piece t-r: it
  keeps the incoming partial prefix as its own P_r piece, adds λ^C · (incoming) + S_r and
  passes the result on. W+K-2 ppermute steps; every step every device sends one piece.
  """
  w = comm.axis_size(axis_name)
  r = lax.axis_index(axis_name)
  n = state.size
  size = -(-n // num_pieces)
  flat = lambda x: jnp.pad(x.reshape(-1), (0, num_pieces * size - n)).reshape(num_pieces, size)
  pieces = flat(state)
  gains = flat(jnp.broadcast_to(chunk_decay[None, :, None, None], state.shape))
  chain = [(i, i + 1) for i in range(w - 1)]
  steps = w + num_pieces - 2
  axes = tuple(comm.varying_axes(state)) + (axis_name,)
  init = comm.varying((jnp.zeros((size,), state.dtype),
                       jnp.zeros((num_pieces, size), state.dtype)), axes)

  def keep(t, incoming, prefix):
    p = t - r
    valid = (p >= 0) & (p < num_pieces)
    pc = jnp.clip(p, 0, num_pieces - 1)
    kept = lax.dynamic_update_index_in_dim(prefix, incoming, pc, axis=0)
    return jnp.where(valid, kept, prefix), pc

  def body(carry, t):
    incoming, prefix = carry
    prefix, pc = keep(t, incoming, prefix)
    outgoing = gains[pc] * incoming + pieces[pc]
    incoming, _ = comm.ppermute(outgoing, axis_name, chain)
    return (incoming, prefix), None

  (incoming, prefix), _ = lax.scan(body, init, jnp.arange(steps))
  prefix, _ = keep(steps, incoming, prefix)
  return prefix.reshape(-1)[:n].reshape(state.shape)


def _linear_attention_chain(q_block, k_block, v_block, axis_name, decay, num_pieces):
  _check_blocks(q_block, k_block, v_block)
  log_decay = _log_decay(decay, q_block.shape[2])
  if axis_name is None:
    return _intra(q_block, k_block, v_block, log_decay)
  if not isinstance(axis_name, str):
    raise ValueError(f"axis_name must be one mesh axis name (a chain), got {axis_name!r}.")
  c = q_block.shape[1]
  state = _chunk_state(k_block, v_block, log_decay)
  prefix = _prefix_chain(state, jnp.exp(c * log_decay), axis_name,
                         num_pieces or comm.axis_size(axis_name))
  return _with_prefix(q_block, k_block, v_block, prefix, log_decay)


def linear_attention_allscan(q_block, k_block, v_block, axis_name: str | None, *,
                             decay=None, num_pieces: int | None = None):
  """Causal linear attention over a sequence sharded on `axis_name`, by All-Scan (ZeCO).

  A pipelined prefix scan: the chunk state is cut into K pieces that flow down the ppermute
  chain 0 -> 1 -> ... -> W-1 one step apart, so each device receives exactly its prefix
  state P_r (no other device's state) after W+K-2 short steps.

  Args:
    q_block: f32[B, T/W, H, Dk] this device's queries (contiguous block r).
    k_block: f32[B, T/W, H, Dk] keys.
    v_block: f32[B, T/W, H, Dv] values.
    axis_name: the sequence mesh axis, or None (one device).
    decay: None, a scalar or f32[H] in (0, 1].
    num_pieces: K, pieces the state is cut into (default W).

  Returns:
    f32[B, T/W, H, Dv]. Wire bytes: `linear_attention_allscan_bytes`.

  References:
    Chou et al., "ZeCO: Zero Communication Overhead Sequence Parallelism for Linear
    Attention", arXiv 2507.01004 (2025). The piece count and schedule here are our
    reading (unverified against the paper's code).

  >>> import jax.numpy as jnp
  >>> x = jnp.ones((1, 3, 1, 1))
  >>> linear_attention_allscan(x, x, x, None)[0, :, 0, 0].tolist()
  [1.0, 2.0, 3.0]
  """
  num_pieces = v.integer("num_pieces", num_pieces, low=1, allow_none=True)
  return _linear_attention_chain(q_block, k_block, v_block, axis_name, decay, num_pieces)


def linear_attention_lasp_ring(q_block, k_block, v_block, axis_name: str | None, *,
                               decay=None):
  """Causal linear attention over a sequence sharded on `axis_name`, by the LASP ring.

  The whole prefix state passes down the ppermute chain one device per step (W-1 steps):
  All-Scan with a single piece, the original LASP schedule.

  Args:
    q_block: f32[B, T/W, H, Dk] this device's queries (contiguous block r).
    k_block: f32[B, T/W, H, Dk] keys.
    v_block: f32[B, T/W, H, Dv] values.
    axis_name: the sequence mesh axis, or None (one device).
    decay: None, a scalar or f32[H] in (0, 1].

  Returns:
    f32[B, T/W, H, Dv]. Wire bytes: `linear_attention_allscan_bytes(..., num_pieces=1)`.

  References:
    Sun et al., "Linear Attention Sequence Parallelism", arXiv 2404.02882.

  >>> import jax.numpy as jnp
  >>> x = jnp.ones((1, 3, 1, 1))
  >>> linear_attention_lasp_ring(x, x, x, None)[0, :, 0, 0].tolist()
  [1.0, 2.0, 3.0]
  """
  return _linear_attention_chain(q_block, k_block, v_block, axis_name, decay, 1)


def _state_bytes(q_block_shape, dv: int | None, dtype) -> float:
  b, _, h, dk = q_block_shape
  return float(b * h * dk * (dv or dk) * jnp.dtype(dtype).itemsize)


def linear_attention_lasp2_bytes(q_block_shape, w: int, *, dv: int | None = None,
                                 dtype=jnp.float32) -> dict:
  """Wire bytes per device of LASP-2: all-gather of the state, reduce-scatter in backward.

  Independent of the sequence length (only B, H, Dk, Dv and W enter).

  >>> linear_attention_lasp2_bytes((1, 16, 2, 4), 4)
  {'forward': 384.0, 'backward': 384.0}
  """
  state = _state_bytes(q_block_shape, dv, dtype)
  return {"forward": comm.all_gather_bytes(state, w),
          "backward": comm.reduce_scatter_bytes(w * state, w)}


def linear_attention_allscan_bytes(q_block_shape, w: int, *, num_pieces: int | None = None,
                                   dv: int | None = None, dtype=jnp.float32) -> dict:
  """Wire bytes per device of All-Scan with K pieces (K=1: the LASP ring).

  W+K-2 ppermute steps of ceil(n/K) elements each (n = B·H·Dk·Dv), forward and again in
  the backward pass; every device sends at every step (fill and drain steps included).
  Independent of the sequence length.

  >>> linear_attention_allscan_bytes((1, 16, 2, 4), 4)
  {'forward': 192.0, 'backward': 192.0}
  """
  k = num_pieces or w
  b, _, h, dk = q_block_shape
  n = b * h * dk * (dv or dk)
  nbytes = (w + k - 2) * -(-n // k) * jnp.dtype(dtype).itemsize
  return {"forward": float(nbytes), "backward": float(nbytes)}
