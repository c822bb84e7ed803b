"""Collective matmul: an all-gather overlapped with the matmul that consumes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm import comm


def _contract(x, kernel, n_in):
  return jnp.tensordot(x, kernel, axes=(tuple(range(x.ndim - n_in, x.ndim)),
                                        tuple(range(n_in))))


def matmul_allgather_overlapped(x_block: jax.Array, kernel: jax.Array,
                                axis_name: comm.AxisName, *, gather_axis: int = 1,
                                n_in: int = 1) -> jax.Array:
  """`all_gather(x_block, gather_axis) @ kernel` without waiting for the whole gather.

  Each device starts with its own block and, for W steps, multiplies the block it holds while
  passing it on to its ring neighbour with `ppermute`: the transfer of step s+1 has no data
  dependence on the matmul of step s, so the scheduler overlaps them. The result rows are
  placed where `all_gather` would have put them. Same wire bytes as the all-gather,
  (W-1) * |x_block|. From the JAX shard_map documentation ("collective matmul").

  Args:
    x_block: this device's block, e.g. f32[B, T/W, D] split along `gather_axis`.
    kernel: f32[D, ...] (the first `n_in` dimensions contract with x's last `n_in`).
    axis_name: the mesh axis the blocks are split over; None for one device.
    gather_axis: the dimension of x the blocks are split along.
    n_in: how many trailing dimensions of x the kernel contracts.

  Returns:
    The full product, e.g. f32[B, T, ...], varying over `axis_name`.

  >>> x, k = jnp.ones((2, 4, 3)), jnp.ones((3, 5))
  >>> matmul_allgather_overlapped(x, k, None).shape
  (2, 4, 5)
  """
  if axis_name is None:
    return _contract(x_block, kernel, n_in)
  n = comm.axis_size(axis_name)
  me = lax.axis_index(axis_name)
  block = x_block.shape[gather_axis]
  out_shape = list(_contract(x_block, kernel, n_in).shape)
  out_shape[gather_axis] *= n
  out = comm.varying(jnp.zeros(out_shape, jnp.result_type(x_block, kernel)), axis_name)
  chunk = x_block
  for step in range(n):
    # Device i holds block (i + step) % n: it received it from device i + 1.
    src = (me + step) % n
    out = lax.dynamic_update_slice_in_dim(out, _contract(chunk, kernel, n_in),
                                          src * block, axis=gather_axis)
    if step + 1 < n:
      chunk, _ = comm.shift(chunk, axis_name, -1)
  return out
