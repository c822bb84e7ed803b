"""Dion: orthonormalised low-rank updates whose factors, not gradients, cross the replicas.

Per matrix (oriented with its longer side as the rows, n x m, n >= m) each replica keeps its
own momentum M_i; Q (m x r) is the same on every replica:

  B_i = M_i + G_i;  P = orth(mean_i B_i Q);  R = mean_i B_i^T P;  M_i <- B_i - (1 - mu) P R^T;
  Q <- R / (|R|_col + eps);  update = -lr (sqrt(fan_out / fan_in) P Q^T + wd X).

The two means over the replica axis are the only replica traffic (n r and m r floats per
matrix); since mean_i M_i follows the same recursion as one Dion run on the mean gradient,
the parameters equal one-device Dion on the mean gradient up to float rounding.

Choices and their sources (the authors' code, `microsoft/dion`, dion.py / dion_reference.py):
* the shape scale sqrt(fan_out / fan_in) (no max(1, .)), mu = 0.95, eps = 1e-8 added to the
  column norms, weight decay 0.01 times the learning rate, the rank r = ceil(rank_fraction x
  min(n, m)), the longer side as P's rows, the first Q standard normal (ours is drawn from
  fold_in(key, crc32 of the matrix's tree path), the same however a layout groups leaves);
* a matrix whose factors are not smaller than it ((n + m) r >= n m) has its gradient
  averaged instead (their `compressed_all_reduce` rule), and its momentum stays equal;
* AdamW or Lion with betas (0.9, 0.95) for the other leaves.
Where we deviate: P is orthonormalised by Householder QR (their qr_method="qr"; the default
there is a randomised Cholesky QR, equal in exact arithmetic up to column signs, which cancel
in P Q^T); the orientation follows the whole shape, not the sharding, so a sharded run is the
unsharded one; a column of R that is exactly zero keeps its Q column for the warm start and
contributes nothing to the update (their rule resets the whole Q when a shard of B is zero).

Sharded over fsdp / tensor (`param_specs`), as the paper's Algorithm 3 shards it: P like the
rows, R and Q like the columns. P = B Q is summed over the axes splitting the columns, P's row
blocks are gathered over the axes splitting the rows for the QR, R = B^T P is summed over the
row axes and R's column norms over the column axes; each counted on its own axes. A sum over
inner axes that precedes the replicas' mean is a reduce-scatter, the replicas' all-reduce of
the slice, and an all-gather (an all-reduce's bytes inside the replica), so the replica axis
carries each factor once per replica, shared by the devices splitting the matrix, not once
per device. (A matrix replicated over an axis its spec does not name, e.g. tensor for an
fsdp-only matrix, still sends its slice from every device of that axis.)
"""

from __future__ import annotations

import math
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.sync import _mean, _powersgd, _shards

SCALAR_OPTIMIZERS = ("adamw", "lion")


class DionState(NamedTuple):
  """State of `dion`'s matrix stage. Group g batches B_g matrices of oriented shape n x m."""
  count: jax.Array   # i32[]: updates done
  momentum: tuple    # per group f32[B_g, n_g, m_g] (local blocks): each replica's own M_i
  q: tuple           # per group f32[B_g, m_g, r_g] (local rows): Q, equal on every replica
  wire_bytes: dict   # {axes label: u32[]}: cumulative bytes sent over those axes


def _label(axes) -> str:
  return "+".join(sorted(axes))


def _live(axes: tuple) -> tuple:
  """The axes of size > 1 (call inside shard_map)."""
  return tuple(a for a in axes if comm.axis_size(a) > 1)


def _rank_rule(rank, rank_fraction):
  if rank is not None:
    return lambda n, m: rank
  return lambda n, m: min(math.ceil(rank_fraction * m), m)


def _factor_sync(g) -> bool:
  return (g.n + g.m) * g.r < g.n * g.m


def _first_q(key, paths: list, leaves: list, g) -> jax.Array:
  """f32[B, m_loc, r]: each member's first Q, drawn from fold_in(key, crc32 of its tree
  path) (so it does not depend on how a layout groups the leaves), this device's rows."""
  q = jnp.stack([jax.random.normal(jax.random.fold_in(key, zlib.crc32(
      jax.tree_util.keystr(paths[i]).encode()) & 0x7FFFFFFF), (g.m, g.r))
                 for i, _, _ in g.members])
  if g.m_axes:
    q = q[:, _powersgd._local_index(g, leaves[g.members[0][0]].shape, 1), :]
  return q


def _matrix_stage(rank_fn, mu: float, eps: float, axis_name, param_specs,
                  key) -> optax.GradientTransformation:
  base_key = jax.random.wrap_key_data(key)
  replica = comm.axis_names(axis_name)

  def make_plan(tree):
    leaves, dims = jax.tree.leaves(tree), None
    if param_specs is not None:
      specs = _shards.spec_leaves(param_specs, tree)
      dims = [_shards.dim_axes(s, len(jnp.shape(x))) for s, x in zip(specs, leaves)]
    plan = _powersgd._plan(leaves, rank_fn, 0.0, True, dims, [1] * len(leaves),
                           longer_first=True)
    for g in plan.groups:
      if not 1 <= g.r <= g.m:
        raise ValueError(f"rank must be in [1, min(n, m)] for every matrix; got {g.r} for a "
                         f"{g.n} x {g.m} matrix (rank_fraction sets it per matrix).")
    return plan

  def labels(plan) -> list:
    keys = {_label(replica)} if replica else set()
    for g in plan.groups:
      rows, cols = _live(g.n_axes), _live(g.m_axes)
      keys.update(_label(a) for a in (rows, cols) if a)
    return sorted(keys)

  def init_fn(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths, leaves = [p for p, _ in flat], [x for _, x in flat]
    plan = make_plan(params)
    return DionState(
        count=jnp.zeros((), jnp.int32),
        momentum=tuple(jnp.zeros(_powersgd._stacked_shape(leaves, g), jnp.float32)
                       for g in plan.groups),
        q=tuple(_first_q(base_key, paths, leaves, g) for g in plan.groups),
        wire_bytes={k: comm.zero_bytes() for k in labels(plan)})

  def update_fn(updates, state, params=None):
    del params
    comm.require_varying(updates, axis_name, "sync.dion")
    leaves, treedef = jax.tree.flatten(updates)
    plan = make_plan(updates)
    shapes = [leaves[g.members[0][0]].shape for g in plan.groups]
    sent = {}

    def add(axes, nbytes):
      if _live(axes) and nbytes:
        sent[_label(_live(axes))] = sent.get(_label(_live(axes)), 0.0) + nbytes

    def replica_mean(parts, synced):
      """Mean over the replicas of the parts whose group syncs, in one buffer."""
      flat = [x.reshape(-1) for x, s in zip(parts, synced) if s]
      if not flat or not replica:
        return parts
      total, nbytes = comm.mean(jnp.concatenate(flat), replica)
      add(replica, nbytes)
      out, offset = [], 0
      for x, s in zip(parts, synced):
        out.append(total[offset:offset + x.size].reshape(x.shape) if s else x)
        offset += x.size if s else 0
      return out

    def factor_mean(partials, axes, synced):
      """sum over `axes[i]` of partials[i] [B, rows, r], then its mean over the replicas when
      synced[i]: a reduce-scatter over the axes (rows zero-padded to a multiple of their
      devices), the replicas' mean of this device's slice, an all-gather back. The inner axes
      carry an all-reduce's bytes; the replicas 1/k of the factor each, not k copies."""
      slices = []
      for x, ax, sync in zip(partials, axes, synced):
        k = comm.axis_size(ax) if (sync and replica and ax) else 1
        if k == 1:
          x, nbytes = comm.sum(x, ax or None)
          add(ax, nbytes)
        else:
          x = jnp.pad(x, ((0, 0), (0, -x.shape[1] % k), (0, 0)))
          x, nbytes = comm.reduce_scatter(x, ax, scatter_dimension=1)
          add(ax, nbytes)
        slices.append(x)
      slices = replica_mean(slices, synced)
      out = []
      for x, full, ax, sync in zip(slices, partials, axes, synced):
        if sync and replica and ax and comm.axis_size(ax) > 1:
          x, nbytes = comm.all_gather(x, ax, axis=1, tiled=True)
          add(ax, nbytes)
          x = x[:, :full.shape[1]]
        out.append(x)
      return out

    synced = [_factor_sync(g) for g in plan.groups]
    grads = replica_mean([_powersgd._stack(leaves, g) for g in plan.groups],
                         [not s for s in synced])  # small matrices: the gradient itself
    bs = [m + g for m, g in zip(state.momentum, grads)]
    ps = factor_mean([_powersgd._matmul(b, q) for b, q in zip(bs, state.q)],
                     [g.m_axes for g in plan.groups], synced)
    p_hats = []
    for g, p, shape in zip(plan.groups, ps, shapes):
      p_hat, nbytes = _powersgd._orthonormalize_whole(p, g, shape, 0.0)
      add(g.n_axes, nbytes)
      p_hats.append(p_hat)
    rs = factor_mean([_powersgd._matmul(jnp.swapaxes(b, 1, 2), p_hat)
                      for b, p_hat in zip(bs, p_hats)], [g.n_axes for g in plan.groups], synced)
    out, momentum, qs = list(leaves), [], []
    for g, b, p_hat, r, q in zip(plan.groups, bs, p_hats, rs, state.q):
      momentum.append(b - (1 - mu) * _powersgd._matmul(p_hat, jnp.swapaxes(r, 1, 2)))
      squares, nbytes = comm.sum(jnp.sum(r * r, axis=1, keepdims=True), g.m_axes or None)
      add(g.m_axes, nbytes)
      norms = jnp.sqrt(squares)
      q_new = r / (norms + eps)
      qs.append(jnp.where(norms > 0, q_new, q))
      _powersgd._unstack(_powersgd._matmul(p_hat, jnp.swapaxes(q_new, 1, 2)), g, leaves, out)
    for g in plan.groups:  # a Flax kernel is fan_in x fan_out
      for i, _, _ in g.members:
        fan_in, fan_out = _shards.global_shape(leaves[i].shape, g.dims or ((), ()))
        out[i] = (math.sqrt(fan_out / fan_in) * out[i]).astype(leaves[i].dtype)
    if set(sent) - set(state.wire_bytes):
      raise AssertionError(f"bytes sent over {set(sent) - set(state.wire_bytes)}, not counted")
    wire = {k: comm.add_bytes(c, sent.get(k, 0.0)) for k, c in state.wire_bytes.items()}
    return jax.tree.unflatten(treedef, out), DionState(state.count + 1, tuple(momentum),
                                                       tuple(qs), wire)

  return optax.GradientTransformation(init_fn, update_fn)


def dion(learning_rate: optax.ScalarOrSchedule, *, rank: int | None = None,
         rank_fraction: float | None = None, mu: float = 0.95, weight_decay: float = 0.01,
         eps: float = 1e-8, axis_name: comm.AxisName = None, param_specs: Any = None,
         key: jax.Array | None = None, scalar_optimizer: str = "adamw",
         scalar_learning_rate: optax.ScalarOrSchedule | None = None,
         scalar_betas: tuple = (0.9, 0.95), scalar_weight_decay: float = 0.0
         ) -> optax.GradientTransformationExtraArgs:
  """Dion, data parallel over `axis_name` by its low-rank factors (module docstring).

  Every 2-D leaf (a Flax kernel, fan_in x fan_out) is a Dion matrix; every other leaf gets the
  mean gradient and AdamW or Lion. Per step the replica axis carries, in two all-reduces, P
  (n r floats) and R (m r floats) of each matrix, with the gradients of the matrices not worth
  compressing: 2 (W-1)/W x 4 (n + m) r bytes per matrix unsharded. With `param_specs` (call
  inside shard_map) the leaves are blocks of matrices split over inner axes: each of the k
  devices splitting a matrix all-reduces 1/k of its factors over the replicas, and the
  inner-axis collectives of the module docstring are counted per axes label in
  `wire_bytes`. Each replica's momentum is stored (and checkpointed) per replica, sharded
  like the parameters inside it.

  Args:
    learning_rate: Dion's learning rate (a number or schedule).
    rank: r for every matrix, in [1, min(n, m)] of each (checked at `init`).
    rank_fraction: r = ceil(rank_fraction x min(n, m)) per matrix, in (0, 1]; give `rank` or
      this (neither: 0.25).
    mu: the error feedback's momentum: M keeps B - (1 - mu) P R^T.
    weight_decay: decoupled weight decay of the matrices (times the learning rate).
    eps: added to R's column norms.
    axis_name: the replica axis (or tuple); None: one replica.
    param_specs: the parameters' PartitionSpecs (a tree like them); None: unsharded leaves.
    key: PRNG key of the first Q (shared by all replicas); None: `jax.random.key(0)`.
    scalar_optimizer: "adamw" or "lion" for the other leaves.
    scalar_learning_rate: their learning rate (None: `learning_rate`).
    scalar_betas: their (b1, b2).
    scalar_weight_decay: their decoupled weight decay.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  References:
    Ahn, Xu, Abreu, Langford, Dion: Distributed Orthonormalized Updates, arXiv 2504.05295
    (Algorithms 1 and 3); `microsoft/dion`.

  A rank-1 gradient u v^T is recovered at rank 1 as u v^T / (|u| |v|):

  >>> import jax.numpy as jnp
  >>> u, v = jnp.array([1.0, 2.0, 2.0, 0.0]), jnp.array([0.0, 2.0])
  >>> params = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}
  >>> tx = dion(0.1, rank=1, weight_decay=0.0)
  >>> grads = {"w": jnp.outer(u, v), "b": jnp.ones(2)}
  >>> updates, _ = tx.update(grads, tx.init(params), params)
  >>> want = -0.1 * jnp.sqrt(2 / 4) * jnp.outer(u / 3, v / 2)  # sqrt(fan_out / fan_in)
  >>> bool(jnp.allclose(updates["w"], want, atol=1e-6))
  True
  """
  if not callable(learning_rate):
    v.number("learning_rate", learning_rate, low=0.0, low_open=True)
  if scalar_learning_rate is not None and not callable(scalar_learning_rate):
    v.number("scalar_learning_rate", scalar_learning_rate, low=0.0, low_open=True)
  if rank is not None and rank_fraction is not None:
    raise ValueError(f"give rank or rank_fraction, not both; got rank={rank!r}, "
                     f"rank_fraction={rank_fraction!r}.")
  rank = v.integer("rank", rank, low=1, allow_none=True)
  if rank is None:
    rank_fraction = v.number("rank_fraction", 0.25 if rank_fraction is None else rank_fraction,
                             low=0.0, high=1.0, low_open=True)
  mu = v.number("mu", mu, low=0.0, high=1.0)
  weight_decay = v.number("weight_decay", weight_decay, low=0.0)
  eps = v.number("eps", eps, low=0.0)
  axis_name = v.axis_name("axis_name", axis_name)
  key = v.key("key", key)
  scalar_optimizer = v.one_of("scalar_optimizer", scalar_optimizer, SCALAR_OPTIMIZERS)
  if not (isinstance(scalar_betas, (tuple, list)) and len(scalar_betas) == 2):
    raise ValueError(f"scalar_betas must be a pair (b1, b2), got {scalar_betas!r}.")
  b1, b2 = (v.number("scalar_betas", b, low=0.0, high=1.0, high_open=True)
            for b in scalar_betas)
  scalar_weight_decay = v.number("scalar_weight_decay", scalar_weight_decay, low=0.0)
  lr = learning_rate if scalar_learning_rate is None else scalar_learning_rate
  scalar = (optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=scalar_weight_decay)
            if scalar_optimizer == "adamw" else
            optax.lion(lr, b1=b1, b2=b2, weight_decay=scalar_weight_decay))
  matrices = optax.chain(
      _matrix_stage(_rank_rule(rank, rank_fraction), mu, eps, axis_name, param_specs, key),
      optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(learning_rate))
  labels = lambda params: jax.tree.map(lambda x: "dion" if x.ndim == 2 else "scalar", params)
  return optax.with_extra_args_support(optax.partition(
      {"dion": matrices, "scalar": optax.chain(_mean.mean(axis_name), scalar)}, labels))
