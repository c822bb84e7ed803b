"""Exact gradient mean over the data axis."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from jaxcomm import _validate as v
from jaxcomm import comm


class MeanState(NamedTuple):
  """State of `mean`."""
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)


def mean(axis_name: comm.AxisName = "data", dtype: Any = None) -> optax.GradientTransformation:
  """Replaces each worker's gradient by the exact mean over `axis_name`.

  Args:
    axis_name: the mesh axis (or tuple of axes) to average over; None for one device.
    dtype: optional dtype the gradients travel in (e.g. `jnp.bfloat16` halves the bytes);
      the result is cast back to each gradient's dtype.

  Returns:
    An `optax.GradientTransformation` whose state counts the wire bytes.

  >>> import jax.numpy as jnp, optax
  >>> tx = optax.chain(mean(axis_name=None), optax.sgd(0.1))
  >>> state = tx.init({"w": jnp.ones(3)})
  >>> updates, state = tx.update({"w": jnp.ones(3)}, state)
  >>> updates["w"]
  Array([-0.1, -0.1, -0.1], dtype=float32)
  """
  axis_name = v.axis_name("axis_name", axis_name)
  dtype = None if dtype is None else v.dtype("dtype", dtype)  # None: the gradients' own

  def init_fn(params):
    del params
    return MeanState(wire_bytes=comm.zero_bytes())

  def update_fn(updates, state, params=None):
    comm.require_varying(updates, axis_name, "sync.mean")
    del params
    updates, nbytes = comm.mean(updates, axis_name, dtype=dtype)
    return updates, MeanState(wire_bytes=comm.add_bytes(state.wire_bytes, nbytes))

  return optax.GradientTransformation(init_fn, update_fn)
