"""Where a device's shard sits in a sharded tensor: for methods that need a global view.

Inside `shard_map` a transform sees its device's shard of each tensor. Methods that are
defined on the whole tensor (PowerSGD's M^T P sums over row shards, its Gram-Schmidt runs
over all rows) need to know how the shard maps into the tensor: which mesh axes split each
dimension and at which offset this device's block starts. A PartitionSpec entry with several
axes splits its dimension row-major over them (the first axis outermost), as shard_map does.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P


def _entry_axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def dim_axes(spec: P | None, ndim: int) -> tuple:
  """The mesh axes splitting each of `ndim` dimensions: a tuple of axis tuples."""
  entries = tuple(spec) if spec is not None else ()
  entries = entries + (None,) * (ndim - len(entries))
  return tuple(_entry_axes(e) for e in entries[:ndim])


def spec_leaves(specs: Any, tree: Any, name: str = "param_specs") -> list:
  """The PartitionSpec of each leaf of `tree`, found by tree path in `specs`.

  `tree` may hold only some of the leaves `specs` describes (`optax.masked` and
  `optax.multi_transform` pass masked trees); all leaves are unsharded when `specs` is None.
  """
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if specs is None:
    return [P()] * len(paths)
  table = {tuple(path): spec for path, spec in jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda s: isinstance(s, P) or s is None)[0]}
  missing = [jax.tree_util.keystr(p) for p in paths if tuple(p) not in table]
  if missing:
    raise ValueError(f"{name} has no PartitionSpec for the leaves {missing[:3]}; pass a tree "
                     f"of PartitionSpecs like the parameters.")
  out = [table[tuple(p)] for p in paths]
  if not all(s is None or isinstance(s, P) for s in out):
    raise ValueError(f"{name} must be a tree of PartitionSpecs, got {out[:3]}.")
  return [P() if s is None else s for s in out]


def _sizes(axes: tuple) -> int:
  return math.prod(lax.axis_size(a) for a in axes)


def global_shape(local_shape: Sequence[int], axes: tuple) -> tuple:
  """The whole tensor's shape from a shard's (call inside shard_map)."""
  return tuple(n * _sizes(a) for n, a in zip(local_shape, axes))


def _block_index(entry_axes: tuple, coords) -> Any:
  """Index of the block of a dimension split row-major over `entry_axes`."""
  index = 0
  for a in entry_axes:
    index = index * lax.axis_size(a) + coords[a]
  return index


def flat_indices(local_shape: Sequence[int], axes: tuple, dims: Sequence[int],
                 coords: dict | None = None) -> jax.Array:
  """i32[prod(local dims)]: row-major index in the whole tensor's `dims` of each local one.

  `coords` maps axis names to this device's (or any device's) index along them; by default
  this device's `lax.axis_index`.
  """
  if coords is None:
    coords = {a: lax.axis_index(a) for d in dims for a in axes[d]}
  whole = global_shape(local_shape, axes)
  index = jnp.zeros((), jnp.int32)
  for d in dims:
    start = _block_index(axes[d], coords) * local_shape[d]
    index = index[..., None] * whole[d] + start + jnp.arange(local_shape[d], dtype=jnp.int32)
  return index.reshape(-1)


def gathered_indices(local_shape: Sequence[int], axes: tuple, dims: Sequence[int],
                     over: tuple) -> jax.Array:
  """The `flat_indices` of every device along `over`, in `all_gather(tiled)`'s order.

  Devices that differ only along `over` are enumerated row-major over `over` (the order of
  an all-gather over that tuple of axes); the other axes are this device's.
  """
  ranges = [range(lax.axis_size(a)) for a in over]
  parts = []
  for point in itertools.product(*ranges):
    coords = {a: lax.axis_index(a) for d in dims for a in axes[d]}
    coords.update(dict(zip(over, (np.int32(i) for i in point))))
    parts.append(flat_indices(local_shape, axes, dims, coords))
  return jnp.concatenate(parts)
