"""Collectives over named mesh axes that also return the bytes they put on the wire.

Every function here is called inside `jax.shard_map` and returns `(result, wire_bytes)`,
where `wire_bytes` is a static Python float: the bytes ONE device sends for that collective
under the bandwidth-optimal algorithm (docs/algorithms.md, "The byte convention").
`axis_name=None` means one device: the functions return their input unchanged and 0 bytes,
so every stage built on them also runs without a mesh.

Results of reductions and gathers are *invariant* over the axis (identical on every device),
which is what lets the step builder tell replicated state from per-worker state.
"""

from __future__ import annotations

import builtins
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax


#: A mesh axis name, a tuple of them (reduced over together), or None (one device: no
#: communication).
AxisName = str | tuple[str, ...] | None


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
  """An axis argument as a tuple of axis names: None -> (), "data" -> ("data",).

  The one normalisation of every `axis_name` argument (and of a PartitionSpec entry).

  Example:
    >>> axis_names(None), axis_names("data"), axis_names(["replica", "data"])
    ((), ('data',), ('replica', 'data'))
  """
  if axis_name is None:
    return ()
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_size(axis_name: AxisName) -> int:
  """Number of devices along `axis_name` (a product for a tuple; 1 for None).

  Example:
    >>> axis_size(None)
    1
  """
  return math.prod(lax.axis_size(a) for a in axis_names(axis_name))


def is_numeric(x: Any) -> bool:
  """Whether a leaf is a numeric array (or ShapeDtypeStruct): not a PRNG key array (an
  extended dtype, which has no itemsize and no gradient) or a non-array leaf.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> is_numeric(jnp.ones(2)), is_numeric(jax.random.key(0)), is_numeric("text")
    (True, False, False)
  """
  dtype = getattr(x, "dtype", None)
  return dtype is not None and hasattr(x, "shape") and \
      not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def tree_bytes(tree: Any, dtype: Any = None) -> int:
  """Bytes of the numeric array leaves of `tree` (arrays or ShapeDtypeStructs), as `dtype`
  if given. PRNG key arrays (a dropout stream's key in an NNX model) and other non-numeric
  leaves are not counted: no gradient or collective carries them (`is_numeric`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> tree_bytes({"w": jnp.ones((2, 3)), "b": jnp.ones(3)}), tree_bytes(jnp.ones(4), jnp.bfloat16)
    (36, 8)
    >>> tree_bytes({"w": jnp.ones(3), "rng": jax.random.key(0)})
    12
  """
  return builtins.sum(math.prod(x.shape) * jnp.dtype(dtype or x.dtype).itemsize
                      for x in jax.tree.leaves(tree) if is_numeric(x))


# Wire-byte formulas, one per collective kind (per device, ring algorithms).
def allreduce_bytes(nbytes: float, w: int) -> float:
  """Wire bytes per device (docs/algorithms.md).

  Example:
    >>> allreduce_bytes(1000, 8)  # ring: 2 (W - 1) / W of the payload
    1750.0
  """
  return 2.0 * (w - 1) / w * nbytes


def reduce_scatter_bytes(nbytes: float, w: int) -> float:
  """Wire bytes per device (docs/algorithms.md).

  Example:
    >>> reduce_scatter_bytes(1000, 8)
    875.0
  """
  return (w - 1) / w * nbytes


def all_gather_bytes(nbytes_per_device: float, w: int) -> float:
  """Wire bytes per device (docs/algorithms.md).

  Example:
    >>> all_gather_bytes(100, 8)  # each device receives the 7 other shards
    700.0
  """
  return float((w - 1) * nbytes_per_device)


def all_to_all_bytes(nbytes: float, w: int) -> float:
  """Wire bytes per device (docs/algorithms.md).

  Example:
    >>> all_to_all_bytes(1000, 8)
    875.0
  """
  return (w - 1) / w * nbytes


def varying(tree: Any, axis_name: AxisName) -> Any:
  """Marks every leaf as varying over `axis_name` (a no-op for axes it already varies over).

  Differentiating with respect to a varying copy of replicated parameters gives each device
  its *local* gradient; without it shard_map's transpose would psum the gradient implicitly.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: varying(x, "data"), mesh=mesh, in_specs=jax.P(),
    ...                   out_specs=jax.P("data"))  # a varying value may leave per device
    >>> f(jnp.ones(1)).shape
    (8,)
  """
  axes = axis_names(axis_name)
  if not axes:
    return tree

  def cast(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes over which a traced value may differ between devices.

  Example:
    >>> import jax.numpy as jnp
    >>> varying_axes(jnp.ones(2))  # outside shard_map nothing varies
    frozenset()
  """
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def _tracks_varying(axis: str) -> bool:
  """Whether the enclosing shard_map tracks varying axes for `axis` (check_vma=True).

  Only then does an invariant value mean "the same on every worker". Under `jax.vmap` with
  an axis name, or shard_map with check_vma=False, nothing is tracked; outside both the axis
  is unbound.
  """
  try:
    return axis in varying_axes(lax.axis_index(axis))
  except NameError:
    return False


def require_varying(tree: Any, axis_name: AxisName, where: str) -> None:
  """ValueError unless every leaf of `tree` varies over every axis of `axis_name`.

  Guards the local-gradient trap: inside a `shard_map`, `jax.grad` with respect to
  replicated (invariant) parameters is summed over the workers by JAX's transpose (an
  implicit psum), so a transform that averages per-worker gradients would average W sums.
  Differentiating with respect to `varying(params, axis_name)` gives each worker its own
  gradient; the Trainer does so. Checked at trace time from the types only (nothing runs);
  a no-op outside shard_map, under vmap, or with check_vma=False.

  Args:
    tree: the gradients (or any per-worker values) the caller received.
    axis_name: the axis (or axes) over which they must differ.
    where: the caller's name, for the message.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> def grads_of(params, x):  # per worker: the gradient of its own loss
    ...   g = jax.grad(lambda p: jnp.sum(p * x))(varying(params, "data"))
    ...   require_varying(g, "data", "my_transform")  # passes; without varying it raises
    ...   return g
    >>> f = jax.shard_map(grads_of, mesh=mesh, in_specs=(jax.P(), jax.P("data")),
    ...                   out_specs=jax.P("data"))
    >>> f(jnp.ones(1), jnp.arange(8.0)).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
  """
  axes = [a for a in axis_names(axis_name) if _tracks_varying(a)]
  if not axes:
    return
  shown = axis_names(axis_name)[0] if len(axis_names(axis_name)) == 1 else axis_names(axis_name)
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    missing = [a for a in axes if a not in varying_axes(leaf)]
    if missing:
      raise ValueError(
          f"{where} needs each worker's own gradient, but the leaf "
          f"{jax.tree_util.keystr(path) or 'at the root'} is the same on every worker of "
          f"{tuple(missing)} (invariant in shard_map's types). Inside your own shard_map, "
          f"jax.grad with respect to replicated parameters returns the SUM over the workers "
          f"(JAX's transpose inserts a psum), which this would then average again. "
          f"Differentiate with respect to jaxcomm.comm.varying(params, {shown!r}) to get "
          f"the local gradient (jaxcomm.train.Trainer does this).")


_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def to_bits(x: jax.Array) -> jax.Array:
  """Bit pattern of a float array as unsigned integers of the same width.

  Narrow floats travel as their bits: XLA:CPU widens a bf16 or fp8 collective operand to
  f32 (it moves the convert across the collective), which would double the real wire bytes.
  Integers are left alone.

  Example:
    >>> import jax.numpy as jnp
    >>> bits = to_bits(jnp.array([1.0], jnp.bfloat16))
    >>> bits.dtype, from_bits(bits, jnp.bfloat16).tolist()
    (dtype('uint16'), [1.0])
  """
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  return lax.bitcast_convert_type(x, _BITS[jnp.dtype(x.dtype).itemsize])


def from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
  """Inverse of `to_bits`.

  Example:
    >>> import jax.numpy as jnp
    >>> from_bits(to_bits(jnp.array([0.5, -2.0])), jnp.float32).tolist()
    [0.5, -2.0]
  """
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    return bits
  return lax.bitcast_convert_type(bits, dtype)


def psum_tree(tree: Any, axis_name: AxisName) -> tuple[Any, float]:
  """psum of every leaf in its own dtype, and the all-reduce's wire bytes (`sum` without a
  wire dtype; the building block of the compressed sums)."""
  axes = axis_names(axis_name)
  if not axes:
    return tree, 0.0
  w = axis_size(axes)
  return jax.tree.map(lambda x: lax.psum(x, axes), tree), allreduce_bytes(tree_bytes(tree), w)


def all_gather(tree: Any, axis_name: AxisName, *, axis: int = 0,
               tiled: bool = False, invariant: bool = True) -> tuple[Any, float]:
  """Gathers every device's leaves along a new (or, if `tiled`, existing) axis `axis`.

  The result is identical on all devices (invariant). Wire bytes: (W-1) * local bytes.
  With `invariant=False` the result is typed as varying: its transpose is then a
  reduce-scatter ((W-1)/W of the gathered bytes) instead of an all-reduce of twice that,
  which is what a gather feeding a per-device computation under `jax.grad` wants.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: all_gather(x, "data", tiled=True)[0], mesh=mesh,
    ...                   in_specs=jax.P("data"), out_specs=jax.P())
    >>> f(jnp.arange(8.0)).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
  """
  axes = axis_names(axis_name)
  if not axes:
    return (tree if tiled else jax.tree.map(lambda x: jnp.expand_dims(x, axis), tree)), 0.0
  w = axis_size(axes)
  to = "invarying" if invariant else "varying"
  out = jax.tree.map(
      lambda x: lax.all_gather(varying(x, axes), axes, axis=axis, tiled=tiled, to=to), tree)
  return out, all_gather_bytes(tree_bytes(tree), w)


def reduce_scatter(tree: Any, axis_name: AxisName, *, scatter_dimension: int = 0,
                   tiled: bool = True) -> tuple[Any, float]:
  """Sums over `axis_name` and leaves device r with the r-th slice along `scatter_dimension`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: reduce_scatter(x, "data")[0], mesh=mesh,
    ...                   in_specs=jax.P(), out_specs=jax.P("data"))
    >>> f(jnp.arange(8.0)).tolist()  # every device held the same vector: 8 x each slice
    [0.0, 8.0, 16.0, 24.0, 32.0, 40.0, 48.0, 56.0]
  """
  axes = axis_names(axis_name)
  if not axes:
    return tree, 0.0
  w = axis_size(axes)
  out = jax.tree.map(
      lambda x: lax.psum_scatter(varying(x, axes), axes, scatter_dimension=scatter_dimension,
                                 tiled=tiled), tree)
  return out, reduce_scatter_bytes(tree_bytes(tree), w)


def all_to_all(tree: Any, axis_name: AxisName, *, split_axis: int = 0,
               concat_axis: int = 0) -> tuple[Any, float]:
  """Device r sends chunk j of its `split_axis` to device j, concatenated on `concat_axis`.

  Example:
    >>> import jax.numpy as jnp
    >>> out, nbytes = all_to_all(jnp.arange(4.0), None)
    >>> out.tolist(), nbytes
    ([0.0, 1.0, 2.0, 3.0], 0.0)
  """
  axes = axis_names(axis_name)
  if not axes:
    return tree, 0.0
  w = axis_size(axes)
  out = jax.tree.map(
      lambda x: lax.all_to_all(varying(x, axes), axes, split_axis, concat_axis, tiled=True),
      tree)
  return out, all_to_all_bytes(tree_bytes(tree), w)


def ppermute(tree: Any, axis_name: AxisName,
             perm: Sequence[tuple[int, int]]) -> tuple[Any, float]:
  """Sends each device's leaves to one peer given by `perm` (source, target) pairs.

  Wire bytes are those of a device that sends: its local bytes.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> perm = [(i, (i + 1) % 8) for i in range(8)]
    >>> f = jax.shard_map(lambda x: ppermute(x, "data", perm)[0], mesh=mesh,
    ...                   in_specs=jax.P("data"), out_specs=jax.P("data"))
    >>> f(jnp.arange(8.0)).tolist()
    [7.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
  """
  axes = axis_names(axis_name)
  if not axes:
    return tree, 0.0
  out = jax.tree.map(lambda x: lax.ppermute(varying(x, axes), axes, perm=list(perm)), tree)
  return out, float(tree_bytes(tree)) if perm else 0.0


def shift(tree: Any, axis_name: AxisName, offset: int) -> tuple[Any, float]:
  """ppermute along a ring: device i receives from device i - offset.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: shift(x, "data", 1)[0], mesh=mesh,
    ...                   in_specs=jax.P("data"), out_specs=jax.P("data"))
    >>> f(jnp.arange(8.0)).tolist()  # device i receives from device i - 1
    [7.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
  """
  axes = axis_names(axis_name)
  if not axes:
    return tree, 0.0
  n = axis_size(axes)
  return ppermute(tree, axes, [(i, (i + offset) % n) for i in range(n)])
