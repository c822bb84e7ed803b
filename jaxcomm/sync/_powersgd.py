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
from jaxcomm.sync import _memory
from jaxcomm.sync import _shards


class PowerSGDState(NamedTuple):
  """State of `powersgd` (and `lq_sgd`). Group g batches B_g matrices of shape n_g x m_g."""
  count: jax.Array                 # int32[]: updates done (start_iter is compared to it)
  q: tuple                         # per group f32[B_g, m_g, r_g]: warm-start Q
                                   # (same on all workers)
  error: tuple | None              # per group, per worker: the memory's buffers shaped
                                   # [B_g, n_g, m_g] ("ef": f32, e_w = M_w - P^ Q_w^T)
  wire_bytes: jax.Array            # u32[]: cumulative bytes sent by this device (mod 2**32)


class _Group(NamedTuple):
  members: tuple  # ((leaf index, transposed, split), ...) in leaf order (see `_split`)
  n: int          # rows of the oriented matrix (the shorter side; Dion's: the longer)
  m: int          # columns, of the whole tensor
  r: int          # rank used: min(rank, n, m)
  # With sharded leaves (`param_specs`), a group holds leaves of one shape and sharding:
  dims: tuple = ()     # mesh axes splitting each dimension of the leaves
  n_axes: tuple = ()   # mesh axes splitting the oriented rows (P^ is orthonormalised whole)
  m_axes: tuple = ()   # mesh axes splitting the columns (P = M Q sums over them)
  origin: tuple = ()   # (group of the unsharded plan, position in it) of each member


class _Plan(NamedTuple):
  exact: tuple    # leaf indices reduced uncompressed (ndim <= 1 or not worth compressing)
  groups: tuple   # _Group, ...
  sizes: tuple = ()  # matrices in each group of the unsharded plan (what Q is drawn for)


def _oriented_dims(ndim: int, transposed: bool, split: int) -> tuple[tuple, tuple]:
  """(dimensions forming the oriented rows, dimensions forming the columns)."""
  rows, cols = tuple(range(split)), tuple(range(split, ndim))
  return (cols, rows) if transposed else (rows, cols)


def _split(shape: tuple, rank: int, view: int | None) -> int:
  """The matrix view of a tensor: dimensions [:k] are its rows, [k:] its columns.

  `view` (the user's, or the model's inputs x outputs) when given; otherwise the k in
  1..ndim-1 that sends the least, min(rank, n, m) (n + m) floats for an n x m view, the
  earliest k on a tie. For a Dense kernel (in, out) that is in x out; for a conv kernel
  (kh, kw, C_in, C_out) kh kw C_in x C_out; for a DenseGeneral kernel (768, 3, 12, 64)
  768 x 2304 (inputs x outputs), not the 27648 x 64 of prod(shape[:-1]) x shape[-1].
  """
  ndim = len(shape)
  if view is not None:
    return view
  def sent(k):
    n, m = math.prod(shape[:k]), math.prod(shape[k:])
    return min(rank, n, m) * (n + m)
  return min(range(1, ndim), key=sent)


def check_views(views: Any) -> Any:
  """None, or a tree of per-leaf matrix views (an int split point k >= 1, or None)."""
  for k in jax.tree.leaves(views):
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
      raise ValueError(f"views must be a tree like the parameters of split points k >= 1 "
                       f"(rows: dimensions [:k], columns [k:]) or None, got {k!r}.")
  return views


def view_leaves(views: Any, tree: Any) -> list:
  """Each leaf's split point from `views` (found by tree path), None where not given."""
  paths = [tuple(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if views is None:
    return [None] * len(paths)
  table = {tuple(path): k for path, k in jax.tree_util.tree_flatten_with_path(views)[0]}
  out = [table.get(path) for path in paths]
  for path, k, x in zip(paths, out, jax.tree.leaves(tree)):
    if k is not None and not k < len(jnp.shape(x)):
      raise ValueError(f"views{jax.tree_util.keystr(path)} = {k} must be < the leaf's "
                       f"{len(jnp.shape(x))} dimensions (shape {jnp.shape(x)}).")
  return out


def _rank_of(rank, n: int, m: int) -> int:
  """The rank used for an n x m matrix: `rank(n, m)` when callable, else min(rank, n, m)."""
  return rank(n, m) if callable(rank) else min(rank, n, m)


def _plan(leaves, rank, min_compression_rate, batch_same_shape, dims=None,
          views=None, longer_first: bool = False) -> _Plan:
  """Which leaves are compressed, viewed and oriented how, batched with which (static).

  Decisions are taken on the whole tensors' shapes (`dims[i]`: the mesh axes splitting
  each dimension of leaf i; then call inside shard_map), so a sharded run compresses
  exactly what an unsharded one does. Sharded leaves are batched only with leaves of the
  same shape and sharding; `origin` remembers their place in the unsharded plan. `rank` is
  an int or a function (n, m) -> r of the oriented shape (then `views` must be given);
  `longer_first` orients the longer side as the rows (Dion's P) instead of the shorter.
  """
  dims = dims or [None] * len(leaves)
  views = views or [None] * len(leaves)
  exact, subgroups, unsharded = [], {}, {}
  for i, x in enumerate(leaves):
    axes = dims[i] or ((),) * len(jnp.shape(x))
    shape = _shards.global_shape(jnp.shape(x), axes)
    if len(shape) <= 1:
      exact.append(i)
      continue
    split = _split(shape, rank, views[i])
    rows, cols = math.prod(shape[:split]), math.prod(shape[split:])
    # PowerSGD: the shorter side first (at rank = min(n, m) P^ is then square and the
    # result exact); Dion: the longer side, the one its QR runs on.
    transposed = rows < cols if longer_first else rows > cols
    n, m = (cols, rows) if transposed else (rows, cols)
    r = _rank_of(rank, n, m)
    if not (n + m) * r * min_compression_rate < n * m:
      exact.append(i)
      continue
    key = (n, m) if batch_same_shape else (n, m, i)
    members = unsharded.setdefault(key, [])
    sharding = (shape, axes, transposed, split) if any(axes) else None
    subgroups.setdefault((key, sharding), []).append((i, transposed, split, len(members)))
    members.append(i)
  keys = list(unsharded)
  groups = []
  for (key, sharding), mem in subgroups.items():
    n_axes = m_axes = axes = ()
    if sharding is not None:
      shape, axes, transposed, split = sharding
      row_dims, col_dims = _oriented_dims(len(shape), transposed, split)
      n_axes = tuple(a for d in row_dims for a in axes[d])
      m_axes = tuple(a for d in col_dims for a in axes[d])
    groups.append(_Group(tuple((i, t, k) for i, t, k, _ in mem), key[0], key[1],
                         _rank_of(rank, key[0], key[1]), dims=axes, n_axes=n_axes, m_axes=m_axes,
                         origin=tuple((keys.index(key), pos) for _, _, _, pos in mem)))
  return _Plan(tuple(exact), tuple(groups), tuple(len(unsharded[k]) for k in keys))


def _stack(leaves, group: _Group) -> jax.Array:
  """f32[B, n, m]: the group's leaves as oriented matrices (local blocks when sharded)."""
  mats = []
  for i, transposed, split in group.members:
    shape = leaves[i].shape
    mat = leaves[i].astype(jnp.float32).reshape(math.prod(shape[:split]), -1)
    mats.append(mat.T if transposed else mat)
  return jnp.stack(mats)


def _stacked_shape(leaves, group: _Group) -> tuple:
  """The shape `_stack` gives (leaves may be ShapeDtypeStructs)."""
  i, transposed, split = group.members[0]
  shape = jnp.shape(leaves[i])
  rows, cols = math.prod(shape[:split]), math.prod(shape[split:])
  return (len(group.members), *((cols, rows) if transposed else (rows, cols)))


def _unstack(batch, group: _Group, leaves, out: list) -> None:
  for b, (i, transposed, _) in enumerate(group.members):
    mat = batch[b].T if transposed else batch[b]
    out[i] = mat.reshape(leaves[i].shape).astype(leaves[i].dtype)


def _local_index(group: _Group, shape, side: int, over: tuple = ()) -> jax.Array:
  """Whole-matrix indices of this device's oriented rows (side 0) or columns (side 1).

  With `over`, the indices of every device along those axes in all-gather order.
  """
  _, transposed, split = group.members[0]
  ds = _oriented_dims(len(shape), transposed, split)[side]
  if over:
    return _shards.gathered_indices(shape, group.dims, ds, over)
  return _shards.flat_indices(shape, group.dims, ds)


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
    # One QR per matrix: XLA:CPU's LAPACK QR splits a batch over the intra-op thread pool
    # and waits for it on a pool thread, which deadlocked once such QRs held every thread
    # (the comparison's one-device Dion step compiled beside an 8-device run on 2 cores).
    mats = p.reshape(-1, *p.shape[-2:])
    q, r = (jnp.stack(x) for x in zip(*(jnp.linalg.qr(m) for m in mats)))
    q, r = q.reshape(p.shape), r.reshape(*p.shape[:-2], *r.shape[-2:])
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


def _initial_q(key, plan: _Plan, group: _Group, leaves) -> jax.Array:
  """f32[B, m, r]: the group's first Q, the rows of the unsharded plan's Q this device holds.

  Q of unsharded group k is drawn from fold_in(key, k), so a sharded run starts from the
  same Q as an unsharded one.
  """
  drawn = {k: jax.random.normal(jax.random.fold_in(key, k), (plan.sizes[k], group.m, group.r))
           for k in sorted({k for k, _ in group.origin})}
  q = jnp.stack([drawn[k][pos] for k, pos in group.origin])
  if group.m_axes:
    q = q[:, _local_index(group, leaves[group.members[0][0]].shape, 1), :]
  return q


def _factor_sizes(plan: _Plan) -> tuple[int, int]:
  """(elements of all P's, elements of all Q's)."""
  p = sum(len(g.members) * g.n * g.r for g in plan.groups)
  q = sum(len(g.members) * g.m * g.r for g in plan.groups)
  return p, q


def _orthonormalize_whole(p: jax.Array, group: _Group, shape, epsilon: float
                          ) -> tuple[jax.Array, float]:
  """P^ rows of this device for P f32[B, n/k, r] whose rows are split over `group.n_axes`.

  The row blocks are all-gathered over those axes (small: n r per matrix), put in the
  whole matrix's row order and orthonormalised as one matrix, exactly as unsharded.
  """
  if not group.n_axes:
    return orthonormalize(p, epsilon), 0.0
  gathered, nbytes = comm.all_gather(p, group.n_axes, axis=1, tiled=True)
  whole = jnp.zeros((p.shape[0], group.n, p.shape[2]), p.dtype)
  whole = whole.at[:, _local_index(group, shape, 0, over=group.n_axes)].set(gathered)
  p_hat = orthonormalize(whole, epsilon)
  return p_hat[:, _local_index(group, shape, 0)], nbytes


def low_rank(rank: int, *, warm_start: bool, memory: _memory.ErrorMemory | None,
             start_iter: int, min_compression_rate: float, orthogonalization_epsilon: float,
             batch_same_shape: bool, axis_name: comm.AxisName, key: jax.Array,
             codec: codecs.Codec | None = None, collective: str | None = None,
             param_specs: Any = None, views: Any = None) -> optax.GradientTransformation:
  """PowerSGD whose P and Q travel through `codec` (None: float32 psum). Validated by callers.

  `key` is raw key data and `memory` the resolved error memory (`check_common`'s results).
  With `param_specs` the leaves are shards (call inside shard_map): each matrix's factors are
  summed over the axes splitting it (see `powersgd`). The memory sees each group's stacked
  matrices as one flat vector (M_w = send(e_w, G_w), e_w <- keep(e_w, M_w, P^ Q_w^T)).
  """
  base_key = jax.random.wrap_key_data(key)

  def send(error, mat):
    """The group's matrices M_w the power iteration compresses (memory.send, flat)."""
    flat = jax.tree.map(lambda b: b.reshape(-1), error)
    return memory.send(flat, mat.reshape(-1)).reshape(mat.shape)

  def keep(error, mat, own):
    """The group's memory after this step (memory.keep on flat views, stored stacked)."""
    flat = jax.tree.map(lambda b: b.reshape(-1), error)
    new = memory.keep(flat, mat.reshape(-1), own.reshape(-1))
    return jax.tree.map(lambda b, x: x.reshape(b.shape), error, new)

  def make_plan(tree):
    leaves, dims = jax.tree.leaves(tree), None
    if param_specs is not None:
      specs = _shards.spec_leaves(param_specs, tree)
      dims = [_shards.dim_axes(spec, len(jnp.shape(x))) for spec, x in zip(specs, leaves)]
    return _plan(leaves, rank, min_compression_rate, batch_same_shape, dims,
                 view_leaves(views, tree))

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    plan = make_plan(params)
    q = tuple(_initial_q(base_key, plan, g, leaves) for g in plan.groups)
    error = None if memory is None else tuple(
        jax.tree.map(lambda b, g=g: b.reshape(_stacked_shape(leaves, g)),
                     memory.init(math.prod(_stacked_shape(leaves, g))))
        for g in plan.groups)
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
    shapes = [leaves[g.members[0][0]].shape for g in plan.groups]
    mats = [_stack(leaves, g) for g in plan.groups]
    if memory is not None:
      mats = [send(e, mat) for mat, e in zip(mats, state.error)]
    if warm_start:
      qs = state.q
    else:  # A fresh Q every step, from a key every worker shares.
      step_key = jax.random.fold_in(base_key, state.count)
      qs = tuple(_initial_q(step_key, plan, g, leaves) for g in plan.groups)
    # 1. P = M Q (summed over the axes splitting the columns of a sharded matrix); the P's
    # of all groups travel in one buffer (with the exact leaves if plain).
    ps, nbytes = [], 0.0
    for g, mat, q in zip(plan.groups, mats, qs):
      p, sent = comm.sum(_matmul(mat, q), g.m_axes or None)
      ps.append(p)
      nbytes += sent
    p_flat = jnp.concatenate([p.reshape(-1) for p in ps]) if ps else jnp.zeros((0,))
    exact_flat = jnp.concatenate([leaves[i].astype(jnp.float32).reshape(-1)
                                  for i in plan.exact]) if plan.exact else jnp.zeros((0,))
    if codec is None:
      both, sent = comm.sum(jnp.concatenate([p_flat, exact_flat]), axis_name)
      p_sum, exact_sum = both[:p_flat.shape[0]], both[p_flat.shape[0]:]
      nbytes += sent
    else:
      p_sum, _, sent = factor_sum(p_flat, w) if plan.groups else (p_flat, None, 0.0)
      nbytes += sent
      exact_sum = exact_flat
      if plan.exact:
        exact_sum, exact_bytes = comm.sum(exact_flat, axis_name)
        nbytes += exact_bytes
    # 2. Orthonormalise (whole matrices); 3. Q_w = M_w^T P^ (summed over row shards).
    p_hats, q_locals, offset = [], [], 0
    for g, mat, p, shape in zip(plan.groups, mats, ps, shapes):
      size = p.size
      p_hat, sent = _orthonormalize_whole(p_sum[offset:offset + size].reshape(p.shape), g,
                                          shape, orthogonalization_epsilon)
      offset += size
      p_hats.append(p_hat)
      q_local, sent2 = comm.sum(_matmul(jnp.swapaxes(mat, 1, 2), p_hat), g.n_axes or None)
      q_locals.append(q_local)
      nbytes += sent + sent2
    # 5. Q = mean_w Q_w (one buffer).
    q_flat = jnp.concatenate([q.reshape(-1) for q in q_locals]) if q_locals else jnp.zeros((0,))
    q_sum, q_sent, q_bytes = factor_sum(q_flat, w) if plan.groups else (q_flat, q_flat, 0.0)
    nbytes += q_bytes
    out = list(leaves)
    new_q, new_error, offset = [], [], 0
    for i, (g, mat, p_hat, q_local) in enumerate(zip(plan.groups, mats, p_hats, q_locals)):
      size, shape = q_local.size, q_local.shape
      q_mean = q_sum[offset:offset + size].reshape(shape) / w
      sent = q_sent[offset:offset + size].reshape(shape)
      offset += size
      # 4. e_w = M_w - P^ Q_w^T with the local Q as it travelled (before the reduction).
      if memory is not None:
        new_error.append(keep(state.error[i], mat, _matmul(p_hat, jnp.swapaxes(sent, 1, 2))))
      new_q.append(q_mean)
      _unstack(_matmul(p_hat, jnp.swapaxes(q_mean, 1, 2)), g, leaves, out)  # 6. G^ = P^ Q^T
    offset = 0
    for i in plan.exact:
      size = leaves[i].size
      out[i] = (exact_sum[offset:offset + size] / w).reshape(leaves[i].shape).astype(
          leaves[i].dtype)
      offset += size
    error = tuple(new_error) if memory is not None else None
    return out, tuple(new_q) if warm_start else state.q, error, nbytes

  def exact_branch(leaves, state):
    out, nbytes = comm.mean(list(leaves), axis_name)
    error = None if state.error is None else comm.varying(state.error, axis_name)
    return out, state.q, error, nbytes

  def update_fn(updates, state, params=None):
    comm.require_varying(updates, axis_name, "sync.powersgd")
    del params
    leaves, treedef = jax.tree.flatten(updates)
    plan = make_plan(updates)

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
  return v.integer("rank", rank, low=1)


def check_common(memory, start_iter, min_compression_rate, orthogonalization_epsilon,
                 key, stage: str) -> tuple[_memory.ErrorMemory | None, jax.Array]:
  """Checks the options shared with `lq_sgd`; returns the resolved memory and the key as raw
  key data."""
  memory = _memory.resolve_memory(memory, accumulate=False, stage=stage)
  v.integer("start_iter", start_iter, low=0)
  v.number("min_compression_rate", min_compression_rate, low=0.0)
  v.number("orthogonalization_epsilon", orthogonalization_epsilon, low=0.0)
  return memory, v.key("key", key)


def powersgd_bytes(params: Any, rank: int, w: int, min_compression_rate: float = 2,
                   batch_same_shape: bool = True, views: Any = None) -> float:
  """docs/algorithms.md wire bytes per device of one compressed PowerSGD step (float32 P and Q).

  One all-reduce of every P with the exact leaves, one of every Q:
  2(W-1)/W * 4 * (sum n r + exact elements) + 2(W-1)/W * 4 * sum m r.

  >>> powersgd_bytes({"w": jnp.zeros((16, 16)), "b": jnp.zeros(16)}, 1, 8)
  336.0
  """
  if w <= 1:
    return 0.0
  leaves = jax.tree.leaves(params)
  plan = _plan(leaves, rank, min_compression_rate, batch_same_shape,
               views=view_leaves(check_views(views), params))
  p, q = _factor_sizes(plan)
  exact = sum(math.prod(jnp.shape(leaves[i])) for i in plan.exact)
  return comm.allreduce_bytes(4 * (p + exact), w) + (comm.allreduce_bytes(4 * q, w) if q else 0.0)


def powersgd(rank: int, warm_start: bool = True, memory: str | _memory.ErrorMemory | None = "ef",
             start_iter: int = 0, min_compression_rate: float = 2,
             orthogonalization_epsilon: float = 0.0, batch_same_shape: bool = True,
             axis_name: comm.AxisName = "data", key: jax.Array | None = None, *,
             param_specs: Any = None, views: Any = None) -> optax.GradientTransformation:
  """Replaces each worker's gradient by PowerSGD's rank-r approximation of the mean.

  Per matrix-shaped tensor (ndim >= 2, viewed as an n x m matrix, see below, oriented with
  the shorter side first so that rank = min(n, m) is exact), with M_w = g_w + e_w:
  1. P = M_w Q, psum P; 2. P^ = Gram-Schmidt(P) (`orthonormalize`); 3. Q_w = M_w^T P^;
  4. e_w <- M_w - P^ Q_w^T; 5. Q = psum(Q_w) / W; 6. the update is P^ Q^T.
  Q starts from `key` (the same on all workers) and is warm-started with the previous
  step's Q. Tensors with ndim <= 1, and matrices where (n + m) r * min_compression_rate >=
  n m, are averaged exactly (they travel in the same all-reduce as P). Matrices of equal
  shape are batched into one matmul per step (`batch_same_shape`), so a step is two
  all-reduces and a few batched matmuls whatever the number of layers. Before `start_iter`
  updates the step is the exact mean (lax.cond; each branch counts its own bytes).

  The matrix view: a tensor's dimensions [:k] are the rows, [k:] the columns. `views` gives k
  per leaf (a layer's inputs x outputs); otherwise k is the split that sends the least,
  min(r, n, m) (n + m) floats, the earliest on a tie. For Flax kernels, which keep the
  outputs last, that is inputs x outputs: a Dense kernel (in, out) as is, a conv kernel
  (kh, kw, C_in, C_out) kh kw C_in x C_out (PyTorch's (C_out) x (C_in kh kw) view,
  transposed), a DenseGeneral kernel (768, 3, 12, 64) 768 x 2304, not 27648 x 64 (which
  sends 9x more at rank 4). PyTorch's shape[0] x prod(rest) would cap a Flax 3x3 conv at
  rank 3.

  Sharded gradients (a replica of a model laid out with FSDP or tensor parallelism; pass the
  leaves' `param_specs`): PowerSGD keeps its global view, so a sharded run computes what an
  unsharded one does. A device holds a block M_loc of each matrix: P = M Q is summed over
  the mesh axes splitting the columns; P's row blocks are all-gathered over the axes
  splitting the rows and orthonormalised as one matrix; Q_w = M^T P^ is summed over the
  row axes. Those inner-axis collectives carry r (n/k + m/k) floats per matrix (k: the
  shard count), counted in `wire_bytes` on their own axes; `axis_name` (the replica axis)
  carries P and Q of this device's blocks. Q and the error memories are stored per device,
  one block each, so their memory falls with the shard count. The plan (which matrices are
  compressed, at which rank, with which first Q) is taken from the whole shapes.

  Args:
    rank: r >= 1 (capped at min(n, m) per matrix).
    warm_start: reuse the previous Q (else a fresh shared random Q every step).
    memory: the per-worker error memory of M_w: "ef" (error feedback, e_w above), None
      (none), "loco" or a `sync.ErrorMemory` (`sync.resolve_memory`; it sees each group of
      matrices as one flat vector, with own = P^ Q_w^T). "ef21" is refused: the update
      P^ Q^T is this step's, with no running mean to accumulate into.
    start_iter: updates done with the exact mean before compressing.
    min_compression_rate: compress a matrix only if (n + m) r * rate < n m.
    orthogonalization_epsilon: added to column norms in Gram-Schmidt.
    batch_same_shape: batch matrices of equal shape into one matmul.
    axis_name: the data axis; None for one device.
    key: PRNG key of the first Q (shared by all workers; also of every fresh Q without
      `warm_start`); None is the fixed default `jax.random.key(0)`.
    param_specs: optional PartitionSpecs of the gradient leaves (a tree like them) when they
      are shards of larger tensors: the method then runs on the whole tensors, see above.
    views: optional matrix views, a tree like the parameters (found by tree path; leaves
      left out use the rule above) of split points k, 1 <= k < ndim: rows are dimensions
      [:k], columns [k:].

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
  memory, key = check_common(memory, start_iter, min_compression_rate,
                             orthogonalization_epsilon, key, "sync.powersgd")
  return low_rank(rank, warm_start=warm_start, memory=memory,
                  start_iter=start_iter, min_compression_rate=min_compression_rate,
                  orthogonalization_epsilon=float(orthogonalization_epsilon),
                  batch_same_shape=batch_same_shape, axis_name=axis_name, key=key,
                  param_specs=param_specs, views=check_views(views))
