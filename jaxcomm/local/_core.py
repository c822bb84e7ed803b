"""What every local-update schedule shares: validation, sync phases, participation.

A schedule counts its updates in an int32[] `count`; update number t = count + 1 (1-based)
is a sync of slot s (a fragment, a layer group, or the single slot of DiLoCo) when
t mod H equals the slot's offset. `Phases` turns that rule into the slot syncing at t and the
0-based index of that sync among all syncs so far, which is what a participation mask is
indexed by.

Participation masks say which workers take part in each sync. A worker that is not live
contributes nothing to that sync's average (it was dropped, or too late for it); like
every worker it continues from the synchronised parameters, which is how a recovered
worker rejoins. Its other state (inner optimiser state, error memories) is kept.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import comm

# A participation mask: a bool[num_syncs, W] array, or `fn(sync_index: i32[]) -> bool[W]`.
Participation = Any


def schedule_args(inner: Any, sync_every: Any, axis_name: Any, participation: Any,
                  axis_arg: str = "axis_name") -> tuple:
  """The checked arguments every schedule shares: (inner, H, axis_name, live_fn).

  `inner` comes back wrapped by `optax.with_extra_args_support`, so a schedule passes any
  extra arguments of its own `update` on to it.
  """
  return (optax.with_extra_args_support(v.transform("inner", inner)),
          v.integer("sync_every", sync_every, low=1, high=2**30),
          v.axis_name(axis_arg, axis_name), resolve_participation(participation))


def _is_list(values: Any) -> bool:
  """A non-empty list, tuple or 1-D array (not a string)."""
  if isinstance(values, np.ndarray):
    return values.ndim == 1 and values.size > 0
  return (isinstance(values, Sequence) and not isinstance(values, (str, bytes))
          and len(values) > 0)


def check_worker_steps(worker_steps: Any, sync_every: int) -> np.ndarray | None:
  """None, or one integer in [1, H] per worker (ValueError naming worker_steps)."""
  if worker_steps is None:
    return None
  if not _is_list(worker_steps):
    raise ValueError(f"worker_steps must be a non-empty list of integers, one per worker; "
                     f"got {worker_steps!r}.")
  return np.asarray([v.integer("worker_steps", s, low=1, high=sync_every)
                     for s in worker_steps])


def check_worker_weights(worker_weights: Any) -> np.ndarray | None:
  """None, or one finite number > 0 per worker (ValueError naming worker_weights)."""
  if worker_weights is None:
    return None
  if not _is_list(worker_weights):
    raise ValueError(f"worker_weights must be a non-empty list of numbers > 0, one per "
                     f"worker; got {worker_weights!r}.")
  for x in worker_weights:
    v.number("worker_weights", x, low=0.0, low_open=True)
  return np.asarray(worker_weights)


def check_offsets(offsets: Any, sync_every: int) -> tuple[int, ...]:
  """Distinct integers in [0, H) (ValueError naming offsets)."""
  if not _is_list(offsets):
    raise ValueError(f"offsets must be a non-empty list of distinct integers in "
                     f"[0, sync_every - 1]; got {offsets!r}.")
  out = tuple(v.integer("offsets", o, low=0, high=sync_every - 1) for o in offsets)
  if len(set(out)) != len(out):
    raise ValueError(f"offsets must be distinct (one slot syncs per update); got {out}.")
  return out


class Phases:
  """Which slot syncs at update t (1-based), for slots at static offsets in [0, H).

  Slot s syncs at every t >= 1 with t mod H == offsets[s]; offsets must be distinct.
  """

  def __init__(self, sync_every: int, offsets: Sequence[int]):
    self.sync_every = sync_every
    self.offsets = np.asarray(offsets, np.int32)
    table = np.full((sync_every,), -1, np.int32)
    for s, off in enumerate(self.offsets):
      table[off] = s
    self._table = table
    # First sync of a slot at offset 0 is at t = H, otherwise at t = offset.
    self._first = np.where(self.offsets == 0, sync_every, self.offsets).astype(np.int32)

  def slot(self, t: jax.Array) -> jax.Array:
    """i32[]: the slot syncing at update t, or -1 if none does (also for t < 1)."""
    s = jnp.asarray(self._table)[jnp.mod(t, self.sync_every)]
    return jnp.where(t >= 1, s, -1)

  def sync_index(self, t: jax.Array) -> jax.Array:
    """i32[]: how many syncs happened at updates 1..t, minus one (the index of a sync at t)."""
    first = jnp.asarray(self._first)
    done = jnp.where(t >= first, (t - first) // self.sync_every + 1, 0)
    return jnp.sum(done) - 1


def resolve_participation(participation: Participation) -> Callable | None:
  """Checks a participation mask at build time; returns `fn(sync_index) -> bool[W]` or None.

  An array row k is the mask of sync k; syncs past the last row have every worker live.
  """
  if participation is None:
    return None
  if callable(participation):
    return participation
  try:
    mask = np.asarray(participation)
  except ValueError as e:  # ragged rows
    raise ValueError("participation must be a bool[num_syncs, num_workers] array (rows of "
                     "equal length) or a callable; got rows of different lengths.") from e
  if mask.ndim != 2 or mask.shape[0] < 1 or mask.shape[1] < 1:
    raise ValueError("participation must be a bool[num_syncs, num_workers] array or a "
                     f"callable of the sync index; got an array of shape {mask.shape}.")
  if mask.dtype != bool:
    if not np.isin(mask, (0, 1)).all():
      raise ValueError("participation entries must be booleans (or 0/1); got values "
                       f"{sorted(set(np.unique(mask).tolist()) - {0, 1})[:5]}.")
    mask = mask.astype(bool)
  dead = np.flatnonzero(~mask.any(axis=1))
  if dead.size:
    raise ValueError(f"participation: every sync needs at least one live worker; syncs "
                     f"{dead.tolist()[:5]} have none.")
  rows = mask.shape[0]
  table = jnp.asarray(mask)

  def fn(k):
    return jnp.where(k < rows, table[jnp.clip(k, 0, rows - 1)], True)

  fn.num_workers = mask.shape[1]
  return fn


def worker_index(axis_name: comm.AxisName) -> jax.Array:
  """i32[]: this worker's index along `axis_name` (0 without an axis).

  A tuple of axes counts in row-major order over them, as the rows of a participation mask
  and `SyncInfo.weights` do.

  >>> import jax, jax.numpy as jnp
  >>> mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> f = jax.shard_map(lambda: worker_index(("a", "b"))[None], mesh=mesh, in_specs=(),
  ...                   out_specs=jax.P(("a", "b")))
  >>> f().tolist(), int(worker_index(None))
  ([0, 1, 2, 3, 4, 5, 6, 7], 0)
  """
  axes = comm.axis_names(axis_name)
  if not axes:
    return jnp.zeros((), jnp.int32)
  return lax.axis_index(axes if len(axes) > 1 else axes[0])


def check_width(name: str, width: int | None, axis_name: comm.AxisName):
  """ValueError if a per-worker argument's length is not the number of workers on the axis.

  Called when the transform is first traced on a mesh (the Trainer does so in `init`, before
  any step), the first moment the number of workers is known.
  """
  w = comm.axis_size(axis_name)
  if width is not None and width != w:
    raise ValueError(f"{name} has {width} workers per sync, but axis_name {axis_name!r} has "
                     f"{w} workers.")


def live_weights(participation: Callable | None, k: jax.Array,
                 axis_name: comm.AxisName) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(this worker's weight f32[], all weights f32[W], live count f32[]) for sync k.

  Without a mask every weight is 1. The mask is a pure function of the sync index, known to
  every worker, so the count needs no collective.
  """
  w = comm.axis_size(axis_name)
  if participation is None:
    row = jnp.ones((w,), jnp.float32)
  else:
    check_width("participation", getattr(participation, "num_workers", None), axis_name)
    row = participation(k)
    if getattr(row, "shape", None) != (w,):
      raise ValueError(f"participation(sync_index) must return bool[{w}] (one entry per "
                       f"worker of axis_name {axis_name!r}), got {row!r}.")
    row = jnp.asarray(row).astype(jnp.float32)
  return row[worker_index(axis_name)], row, jnp.sum(row)


def masked_sum(tree: Any, mine: jax.Array, axis_name: comm.AxisName) -> tuple[Any, float]:
  """Sum over workers of `mine` × `tree` (one all-reduce), and the wire bytes.

  Args:
    tree: this worker's values (a pytree of arrays).
    mine: f32[], this worker's weight (`SyncInfo.mine`: 0 for a worker not live).
    axis_name: the axis (or axes) to sum over; None for one device.

  Returns:
    `(sum like tree, wire bytes)`: the sum is the same on every worker.

  >>> import jax, jax.numpy as jnp
  >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> live = jnp.array([1.0, 1, 1, 1, 1, 1, 1, 0])  # worker 7 is not live
  >>> f = jax.shard_map(lambda x: masked_sum(x, live[worker_index("data")], "data")[0],
  ...                   mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P())
  >>> f(jnp.arange(8.0)).tolist()  # 0 + 1 + ... + 6
  [21.0]
  """
  return comm.sum(jax.tree.map(lambda x: x * mine.astype(x.dtype), tree), axis_name)


def live_mean_or_keep(total: Any, count: jax.Array, tree: Any) -> Any:
  """`total / count`, or each worker's own `tree` when no worker was live."""
  return jax.tree.map(
      lambda s, x: jnp.where(count > 0, s / jnp.maximum(count, 1).astype(s.dtype), x),
      total, tree)


def masked_average(tree: Any, mine: jax.Array, count: jax.Array,
                   axis_name: comm.AxisName) -> tuple[Any, float]:
  """Mean of `tree` over the live workers (weights `mine`), and the wire bytes.

  One all-reduce of the weighted tree; the division by the live count is local. If no worker
  is live every worker keeps its own values.

  Args:
    tree: this worker's values (a pytree of arrays).
    mine: f32[], this worker's weight (`SyncInfo.mine`).
    count: f32[], the sum of all workers' weights (`SyncInfo.total`).
    axis_name: the axis (or axes) of the workers; None for one device.

  Returns:
    `(Σ_w mine_w tree_w / count, wire bytes)`.

  >>> import jax.numpy as jnp
  >>> masked_average({"w": jnp.ones(2)}, jnp.float32(1), jnp.float32(1), None)
  ({'w': Array([1., 1.], dtype=float32)}, 0.0)
  """
  total, nbytes = masked_sum(tree, mine, axis_name)
  return live_mean_or_keep(total, count, tree), nbytes


def updates_to(new_params: Any, params: Any) -> Any:
  """The updates that move `params` to `new_params`, in the parameters' dtypes."""
  return jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new_params, params)


def require_params(params: Any, name: str):
  if params is None:
    raise ValueError(f"{name} needs `params` in update(updates, state, params).")
