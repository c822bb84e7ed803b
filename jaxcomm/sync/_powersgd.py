"""PowerSGD: rank-r gradient compression by one step of power iteration per update.

The low-rank machinery here is shared with LQ-SGD (`_lq_sgd.py`), whose P and Q travel
log-quantised instead of as float32.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm

MEMORIES = (None, "ef")


class PowerSGDState(NamedTuple):
  """State of `powersgd` (and `lq_sgd`). Group g batches B_g matrices of shape n_g x m_g."""
  count: jax.Array                 # int32[]: updates done (start_iter is compared to it)
  q: tuple                         # per group f32[B_g, m_g, r_g]: warm-start Q (same on all workers)
  error: tuple | None              # per group f32[B_g, n_g, m_g], per worker: e_w = M_w - P^ Q_w^T
  wire_bytes: jax.Array            # u32[]: cumulative bytes sent by this device (mod 2**32)


class _Group(NamedTuple):
  members: tuple  # ((leaf index, transposed), ...) in leaf order
  n: int          # rows of the oriented matrix (the shorter side)
  m: int          # columns
  r: int          # rank used: min(rank, n, m)


class _Plan(NamedTuple):
  exact: tuple    # leaf indices reduced uncompressed (ndim <= 1 or not worth compressing)
  groups: tuple   # _Group, ...


def _plan(leaves, rank, min_compression_rate, batch_same_shape) -> _Plan:
  """Which leaves are compressed, oriented how, and batched with which others (static)."""
  exact, by_key = [], {}
  for i, x in enumerate(leaves):
    shape = jnp.shape(x)
    if len(shape) <= 1:
      exact.append(i)
      continue
    rows, cols = math.prod(shape[:-1]), shape[-1]
    # The shorter side first: at rank = min(n, m) P^ is then square and the result exact.
    n, m, transposed = (cols, rows, True) if rows > cols else (rows, cols, False)
    r = min(rank, n)
    if not (n + m) * r * min_compression_rate < n * m:
      exact.append(i)
      continue
    key = (n, m) if batch_same_shape else (n, m, i)
    by_key.setdefault(key, []).append((i, transposed))
  groups = tuple(_Group(tuple(mem), k[0], k[1], min(rank, k[0])) for k, mem in by_key.items())
  return _Plan(tuple(exact), groups)


def _stack(leaves, group: _Group) -> jax.Array:
  """f32[B, n, m]: the group's leaves as oriented matrices."""
  mats = []
  for i, transposed in group.members:
    mat = leaves[i].astype(jnp.float32).reshape(-1, leaves[i].shape[-1])
    mats.append(mat.T if transposed else mat)
  return jnp.stack(mats)


def _unstack(batch, group: _Group, leaves, out: list) -> None:
  for b, (i, transposed) in enumerate(group.members):
    mat = batch[b].T if transposed else batch[b]
    out[i] = mat.reshape(leaves[i].shape).astype(leaves[i].dtype)


def orthonormalize(p: jax.Array, epsilon: float = 0.0) -> jax.Array:
  """Orthonormal columns spanning those of each matrix of a batch p: f32[B, n, r].

  epsilon == 0: a Householder QR with the signs fixed so that R has a non-negative diagonal,
  which is exactly what Gram-Schmidt computes, but stays orthonormal when P is ill
  conditioned (float32 Gram-Schmidt loses orthogonality in proportion to cond(P), and then
  even full-rank PowerSGD is not exact) and is one batched op instead of r^2 / 2.
  epsilon > 0: PyTorch's Gram-Schmidt, each column divided by (its norm + epsilon); a zero
  column stays zero.
  """
  if epsilon == 0:
    q, r = jnp.linalg.qr(p)
    d = jnp.diagonal(r, axis1=-2, axis2=-1)
    return q * jnp.where(d < 0, -1.0, 1.0)[..., None, :]
  cols = [p[..., i] for i in range(p.shape[-1])]
  for i in range(len(cols)):
    norm = jnp.linalg.norm(cols[i], axis=-1, keepdims=True)
    cols[i] = jnp.where(norm > 0, cols[i] / (norm + epsilon), 0.0)
    for j in range(i + 1, len(cols)):
      cols[j] = cols[j] - jnp.sum(cols[i] * cols[j], axis=-1, keepdims=True) * cols[i]
  return jnp.stack(cols, axis=-1)


def _matmul(a, b):
  return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def _initial_q(key, group: _Group, index: int) -> jax.Array:
  return jax.random.normal(jax.random.fold_in(key, index), (len(group.members), group.m, group.r))


def _factor_sizes(plan: _Plan) -> tuple[int, int]:
  """(elements of all P's, elements of all Q's)."""
  p = sum(len(g.members) * g.n * g.r for g in plan.groups)
  q = sum(len(g.members) * g.m * g.r for g in plan.groups)
  return p, q


def low_rank(rank: int, *, warm_start: bool, memory: str | None, start_iter: int,
             min_compression_rate: float, orthogonalization_epsilon: float,
             batch_same_shape: bool, axis_name: comm.AxisName, key: jax.Array,
             codec: codecs.Codec | None = None,
             collective: str | None = None) -> optax.GradientTransformation:
  """PowerSGD whose P and Q travel through `codec` (None: float32 psum). Validated by callers.

  `key` is raw key data (`check_common`'s result).
  """
  base_key = jax.random.wrap_key_data(key)
  error_feedback = memory == "ef"

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    plan = _plan(leaves, rank, min_compression_rate, batch_same_shape)
    q = tuple(_initial_q(base_key, g, k) for k, g in enumerate(plan.groups))
    error = (tuple(jnp.zeros((len(g.members), g.n, g.m), jnp.float32) for g in plan.groups)
             if error_feedback else None)
    return PowerSGDState(count=jnp.zeros((), jnp.int32), q=q, error=error,
                         wire_bytes=comm.zero_bytes())

  def factor_sum(vec, w):
    """Sum over workers of a flat factor vector; returns (sum, what this worker sent, bytes)."""
    if codec is None:
      total, nbytes = comm.sum(vec, axis_name)
      return total, vec, nbytes
    out, nbytes = comm.compressed_sum(vec, codec, axis_name, collective)
    del w
    return out.total, out.own, nbytes

  def compressed_branch(leaves, state, plan):
    w = comm.axis_size(axis_name)
    mats = [_stack(leaves, g) for g in plan.groups]
    if error_feedback:
      mats = [mat + e for mat, e in zip(mats, state.error)]
    if warm_start:
      qs = state.q
    else:  # A fresh Q every step, from a key every worker shares.
      step_key = jax.random.fold_in(base_key, state.count)
      qs = tuple(_initial_q(step_key, g, k) for k, g in enumerate(plan.groups))
    # 1. P = M Q; the P's of all groups travel in one buffer (with the exact leaves if plain).
    ps = [_matmul(mat, q) for mat, q in zip(mats, qs)]
    p_flat = jnp.concatenate([p.reshape(-1) for p in ps]) if ps else jnp.zeros((0,))
    exact_flat = jnp.concatenate([leaves[i].astype(jnp.float32).reshape(-1)
                                  for i in plan.exact]) if plan.exact else jnp.zeros((0,))
    nbytes = 0.0
    if codec is None:
      both, nbytes = comm.sum(jnp.concatenate([p_flat, exact_flat]), axis_name)
      p_sum, exact_sum = both[:p_flat.shape[0]], both[p_flat.shape[0]:]
    else:
      p_sum, _, nbytes = factor_sum(p_flat, w) if plan.groups else (p_flat, None, 0.0)
      exact_sum = exact_flat
      if plan.exact:
        exact_sum, exact_bytes = comm.sum(exact_flat, axis_name)
        nbytes += exact_bytes
    # 2. Orthonormalise; 3. Q_w = M_w^T P^.
    p_hats, q_locals, offset = [], [], 0
    for g, mat in zip(plan.groups, mats):
      size = len(g.members) * g.n * g.r
      p_hat = orthonormalize(p_sum[offset:offset + size].reshape(len(g.members), g.n, g.r),
                             orthogonalization_epsilon)
      offset += size
      p_hats.append(p_hat)
      q_locals.append(_matmul(jnp.swapaxes(mat, 1, 2), p_hat))
    # 5. Q = mean_w Q_w (one buffer).
    q_flat = jnp.concatenate([q.reshape(-1) for q in q_locals]) if q_locals else jnp.zeros((0,))
    q_sum, q_sent, q_bytes = factor_sum(q_flat, w) if plan.groups else (q_flat, q_flat, 0.0)
    nbytes += q_bytes
    out = list(leaves)
    new_q, new_error, offset = [], [], 0
    for g, mat, p_hat in zip(plan.groups, mats, p_hats):
      size = len(g.members) * g.m * g.r
      shape = (len(g.members), g.m, g.r)
      q_mean = q_sum[offset:offset + size].reshape(shape) / w
      sent = q_sent[offset:offset + size].reshape(shape)
      offset += size
      # 4. e_w = M_w - P^ Q_w^T with the local Q as it travelled (before the reduction).
      new_error.append(mat - _matmul(p_hat, jnp.swapaxes(sent, 1, 2)))
      new_q.append(q_mean)
      _unstack(_matmul(p_hat, jnp.swapaxes(q_mean, 1, 2)), g, leaves, out)  # 6. G^ = P^ Q^T
    offset = 0
    for i in plan.exact:
      size = leaves[i].size
      out[i] = (exact_sum[offset:offset + size] / w).reshape(leaves[i].shape).astype(
          leaves[i].dtype)
      offset += size
    error = tuple(new_error) if error_feedback else None
    return out, tuple(new_q) if warm_start else state.q, error, nbytes

  def exact_branch(leaves, state):
    out, nbytes = comm.mean(list(leaves), axis_name)
    error = None if state.error is None else comm.varying(state.error, axis_name)
    return out, state.q, error, nbytes

  def update_fn(updates, state, params=None):
    comm.require_varying(updates, axis_name, "sync.powersgd")
    del params
    leaves, treedef = jax.tree.flatten(updates)
    plan = _plan(leaves, rank, min_compression_rate, batch_same_shape)

    def run(branch):
      out, q, error, nbytes = branch()
      return out, q, error, comm.add_bytes(state.wire_bytes, nbytes)

    compress = lambda: run(lambda: compressed_branch(leaves, state, plan))
    if start_iter > 0:
      out, q, error, counter = lax.cond(state.count < start_iter,
                                        lambda: run(lambda: exact_branch(leaves, state)),
                                        compress)
    else:
      out, q, error, counter = compress()
    new_state = PowerSGDState(count=state.count + 1, q=q, error=error, wire_bytes=counter)
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def check_rank(rank) -> int:
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"rank must be an int >= 1, got {rank!r}.")
  return rank


def check_common(memory, start_iter, min_compression_rate, orthogonalization_epsilon,
                 key) -> jax.Array:
  """Checks the options shared with `lq_sgd`; returns the key as raw key data."""
  v.one_of("memory", memory, MEMORIES)
  if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
    raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}.")
  if not isinstance(min_compression_rate, (int, float)) or min_compression_rate < 0:
    raise ValueError(f"min_compression_rate must be a number >= 0, got {min_compression_rate!r}.")
  if not isinstance(orthogonalization_epsilon, (int, float)) or orthogonalization_epsilon < 0:
    raise ValueError(f"orthogonalization_epsilon must be a number >= 0, got "
                     f"{orthogonalization_epsilon!r}.")
  return v.key("key", key)


def powersgd_bytes(params: Any, rank: int, w: int, min_compression_rate: float = 2,
                   batch_same_shape: bool = True) -> float:
  """docs/algorithms.md wire bytes per device of one compressed PowerSGD step (float32 P and Q).

  One all-reduce of every P with the exact leaves, one of every Q:
  2(W-1)/W * 4 * (sum n r + exact elements) + 2(W-1)/W * 4 * sum m r.

  >>> powersgd_bytes({"w": jnp.zeros((16, 16)), "b": jnp.zeros(16)}, 1, 8)
  336.0
  """
  if w <= 1:
    return 0.0
  leaves = jax.tree.leaves(params)
  plan = _plan(leaves, rank, min_compression_rate, batch_same_shape)
  p, q = _factor_sizes(plan)
  exact = sum(math.prod(jnp.shape(leaves[i])) for i in plan.exact)
  return comm.allreduce_bytes(4 * (p + exact), w) + (comm.allreduce_bytes(4 * q, w) if q else 0.0)


def powersgd(rank: int, warm_start: bool = True, memory: str | None = "ef",
             start_iter: int = 0, min_compression_rate: float = 2,
             orthogonalization_epsilon: float = 0.0, batch_same_shape: bool = True,
             axis_name: comm.AxisName = "data", key: jax.Array | None = None
             ) -> optax.GradientTransformation:
  """Replaces each worker's gradient by PowerSGD's rank-r approximation of the mean.

  Per matrix-shaped tensor (ndim >= 2, viewed as prod(shape[:-1]) x shape[-1], oriented with
  the shorter side first so that rank = min(n, m) is exact), with M_w = g_w + e_w:
  1. P = M_w Q, psum P; 2. P^ = Gram-Schmidt(P) (`orthonormalize`); 3. Q_w = M_w^T P^;
  4. e_w <- M_w - P^ Q_w^T; 5. Q = psum(Q_w) / W; 6. the update is P^ Q^T.
  Q starts from `key` (the same on all workers) and is warm-started with the previous
  step's Q. Tensors with ndim <= 1, and matrices where (n + m) r * min_compression_rate >=
  n m, are averaged exactly (they travel in the same all-reduce as P). Matrices of equal
  shape are batched into one matmul per step (`batch_same_shape`), so a step is two
  all-reduces and a few batched matmuls whatever the number of layers. Before `start_iter`
  updates the step is the exact mean (lax.cond; each branch counts its own bytes).

  The matrix view differs from the paper's (PyTorch) shape[0] x prod(rest) on purpose: Flax
  keeps output features LAST (a conv kernel is kh x kw x C_in x C_out), so shape[0] of a 3x3
  conv is 3, which would cap the rank at 3 and leave every conv uncompressed at rank >= 2.
  prod(shape[:-1]) x shape[-1] is PyTorch's (C_out) x (C_in kh kw) view, transposed.

  Args:
    rank: r >= 1 (capped at min(n, m) per matrix).
    warm_start: reuse the previous Q (else a fresh shared random Q every step).
    memory: "ef" keeps the per-worker error memory e_w (error feedback); None keeps none.
    start_iter: updates done with the exact mean before compressing.
    min_compression_rate: compress a matrix only if (n + m) r * rate < n m.
    orthogonalization_epsilon: added to column norms in Gram-Schmidt.
    batch_same_shape: batch matrices of equal shape into one matmul.
    axis_name: the data axis; None for one device.
    key: PRNG key of the first Q (shared by all workers; also of every fresh Q without
      `warm_start`); None is the fixed default `jax.random.key(0)`.

  Returns:
    An `optax.GradientTransformation`; its state keeps Q, the error memories (per worker)
    and the wire bytes.

  References:
    Vogels, Karimireddy, Jaggi, PowerSGD, arXiv 1905.13727; PyTorch's PowerSGDState.

  >>> import jax.numpy as jnp
  >>> tx = powersgd(rank=1, min_compression_rate=0, axis_name=None)
  >>> g = {"w": jnp.outer(jnp.arange(1., 4.), jnp.arange(1., 5.))}  # rank 1
  >>> updates, state = tx.update(g, tx.init(g))
  >>> bool(jnp.allclose(updates["w"], g["w"], atol=1e-4))
  True
  """
  check_rank(rank)
  key = check_common(memory, start_iter, min_compression_rate, orthogonalization_epsilon, key)
  return low_rank(rank, warm_start=warm_start, memory=memory,
                  start_iter=start_iter, min_compression_rate=min_compression_rate,
                  orthogonalization_epsilon=float(orthogonalization_epsilon),
                  batch_same_shape=batch_same_shape, axis_name=axis_name, key=key)
