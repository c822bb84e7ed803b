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

from jaxcomm.codecs import Codec
from jaxcomm.codecs import flatten as _flatten

AxisName = str | tuple[str, ...] | None


def _axes(axis_name: AxisName) -> tuple[str, ...]:
  if axis_name is None:
    return ()
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_size(axis_name: AxisName) -> int:
  """Number of devices along `axis_name` (a product for a tuple; 1 for None).

  Example:
    >>> axis_size(None)
    1
  """
  return math.prod(lax.axis_size(a) for a in _axes(axis_name))


def tree_bytes(tree: Any, dtype: Any = None) -> int:
  """Bytes of all array leaves of `tree` (arrays or ShapeDtypeStructs), as `dtype` if given.

  Example:
    >>> import jax.numpy as jnp
    >>> tree_bytes({"w": jnp.ones((2, 3)), "b": jnp.ones(3)}), tree_bytes(jnp.ones(4), jnp.bfloat16)
    (36, 8)
  """
  return builtins.sum(math.prod(x.shape) * jnp.dtype(dtype or x.dtype).itemsize
                      for x in jax.tree.leaves(tree))


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
  axes = _axes(axis_name)
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


def two_phase_sum(vec: jax.Array, axis_name: AxisName, dtype: Any) -> tuple[jax.Array, float]:
  """Sum of a flat vector over `axis_name` whose payload travels as `dtype`.

  All-to-all of W chunks in `dtype`, float32 reduction of chunk r on device r, all-gather of
  the reduced chunks in `dtype`: 2(W-1)/W * S * b bytes, like a ring all-reduce, but every
  byte on the wire really is `dtype` (XLA:CPU would widen a bf16 all-reduce to f32). The
  vector is zero-padded to a multiple of W; the padding travels and is counted. This is
  `two_phase` (jaxcomm/comm/_compressed.py) with a cast codec.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: two_phase_sum(x, "data", jnp.bfloat16)[0], mesh=mesh,
    ...                   in_specs=jax.P(), out_specs=jax.P())
    >>> f(jnp.ones(16)).tolist() == [8.0] * 16
    True
  """
  from jaxcomm.comm import _compressed  # pylint: disable=import-outside-toplevel  (builds on this module)
  if not _axes(axis_name):
    return vec, 0.0
  dt = jnp.dtype(dtype)
  codec = Codec(f"cast({dt.name})", encode=lambda x, key: (x.astype(dt),),
                decode=lambda p, n: p[0].astype(jnp.float32),
                payload_bytes=lambda n: dt.itemsize * n, linear=True)
  out, nbytes = _compressed.two_phase(vec.astype(jnp.float32), codec, axis_name)
  return out.total.astype(vec.dtype), nbytes


def _reduce(tree, axis_name, dtype):
  axes = _axes(axis_name)
  if not axes:
    return tree, 0.0
  w = axis_size(axes)
  leaves = jax.tree.leaves(tree)
  if dtype is None or all(jnp.dtype(x.dtype) == jnp.dtype(dtype) for x in leaves):
    return jax.tree.map(lambda x: lax.psum(x, axes), tree), allreduce_bytes(tree_bytes(tree), w)
  # A different wire dtype: one flat buffer through the two-phase reduction.
  flat, unflatten = _flatten(tree)
  total, nbytes = two_phase_sum(flat, axes, jnp.dtype(dtype))
  return unflatten(total), nbytes


def sum(tree: Any, axis_name: AxisName, dtype: Any = None) -> tuple[Any, float]:  # pylint: disable=redefined-builtin
  """All-reduce sum over `axis_name`.

  With a `dtype` other than the leaves' own, the leaves travel as one flat buffer in `dtype`
  through `two_phase_sum` (accumulated in float32); otherwise one `psum` per leaf.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: sum(x, "data")[0], mesh=mesh, in_specs=jax.P("data"),
    ...                   out_specs=jax.P())
    >>> f(jnp.arange(8.0)).tolist(), sum(jnp.ones(2), None)[1]
    ([28.0], 0.0)
  """
  return _reduce(tree, axis_name, dtype)


def mean(tree: Any, axis_name: AxisName, dtype: Any = None) -> tuple[Any, float]:
  """All-reduce mean over `axis_name`, optionally travelling as `dtype` (see `sum`).

  The division by W happens after the reduction, in the input's dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> out, nbytes = mean({"w": jnp.ones(3)}, None)  # one device: identity, nothing sent
    >>> out["w"].tolist(), nbytes
    ([1.0, 1.0, 1.0], 0.0)
  """
  axes = _axes(axis_name)
  total, nbytes = _reduce(tree, axis_name, dtype)
  if not axes:
    return total, nbytes
  w = axis_size(axes)
  return jax.tree.map(lambda x: x / jnp.asarray(w, x.dtype), total), nbytes


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
  axes = _axes(axis_name)
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
  axes = _axes(axis_name)
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
  axes = _axes(axis_name)
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
  axes = _axes(axis_name)
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
  axes = _axes(axis_name)
  if not axes:
    return tree, 0.0
  n = axis_size(axes)
  return ppermute(tree, axes, [(i, (i + offset) % n) for i in range(n)])
