"""All-reduce sum and mean of trees, optionally travelling in a narrower float dtype.

`sum` and `mean` psum each leaf in its own dtype; with a `dtype` other than the leaves' own
the leaves travel as one flat buffer through `two_phase_sum`, the two-phase compressed
all-reduce (`_compressed.two_phase`) with a cast codec, so every byte counted is on the wire.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm.codecs import Codec
from jaxcomm.codecs import flatten as _flatten
from jaxcomm.comm._collectives import AxisName, axis_names, axis_size, psum_tree
from jaxcomm.comm._compressed import two_phase


def two_phase_sum(vec: jax.Array, axis_name: AxisName, dtype: Any) -> tuple[jax.Array, float]:
  """Sum of a flat vector over `axis_name` whose payload travels as `dtype`.

  All-to-all of W chunks in `dtype`, float32 reduction of chunk r on device r, all-gather of
  the reduced chunks in `dtype`: 2(W-1)/W * S * b bytes, like a ring all-reduce, but every
  byte on the wire really is `dtype` (XLA:CPU would widen a bf16 all-reduce to f32). The
  vector is zero-padded to a multiple of W; the padding travels and is counted. This is
  `two_phase` with a cast codec.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: two_phase_sum(x, "data", jnp.bfloat16)[0], mesh=mesh,
    ...                   in_specs=jax.P(), out_specs=jax.P())
    >>> f(jnp.ones(16)).tolist() == [8.0] * 16
    True
  """
  if not axis_names(axis_name):
    return vec, 0.0
  dt = jnp.dtype(dtype)
  codec = Codec(f"cast({dt.name})", encode=lambda x, key: (x.astype(dt),),
                decode=lambda p, n: p[0].astype(jnp.float32),
                payload_bytes=lambda n: dt.itemsize * n, linear=True)
  out, nbytes = two_phase(vec.astype(jnp.float32), codec, axis_name)
  return out.total.astype(vec.dtype), nbytes


def _reduce(tree, axis_name, dtype):
  axes = axis_names(axis_name)
  if not axes:
    return tree, 0.0
  leaves = jax.tree.leaves(tree)
  if dtype is None or all(jnp.dtype(x.dtype) == jnp.dtype(dtype) for x in leaves):
    return psum_tree(tree, axes)
  # A different wire dtype: one flat buffer through the two-phase reduction.
  flat, unflatten = _flatten(tree)
  total, nbytes = two_phase_sum(flat, axes, jnp.dtype(dtype))
  return unflatten(total), nbytes


def sum(tree: Any, axis_name: AxisName, dtype: Any = None) -> tuple[Any, float]:
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
  axes = axis_names(axis_name)
  total, nbytes = _reduce(tree, axis_name, dtype)
  if not axes:
    return total, nbytes
  w = axis_size(axes)
  return jax.tree.map(lambda x: x / jnp.asarray(w, x.dtype), total), nbytes
