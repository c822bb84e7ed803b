"""Megatron tensor parallelism: column- and row-parallel dense layers, MLP and attention.

Inside `shard_map`, a column-parallel layer holds a slice of the output features and a
row-parallel layer the matching slice of the input features, so an MLP (or attention with
its heads split) needs one all-reduce, after the row-parallel layer (arXiv 1909.08053).

The backward all-reduce of Megatron's `f` operator (identity forward, all-reduce backward,
at the input of the column-parallel layer) is not written here: the block's input is
*invariant* over the tensor axis and the column kernel *varies*, so shard_map inserts an
implicit `pvary` whose transpose is exactly that `psum`. The forward `psum` after the
row-parallel layer is the `g` operator; its transpose needs no communication.

With `sequence_parallel=True` (Megatron-SP, arXiv 2205.05198) the block's input is this
device's slice of the sequence: it is all-gathered over the tensor axis before the
column-parallel layer and the row-parallel output is reduce-scattered back to sequence
slices, so norms and residuals work on 1/T of the activations. Same wire bytes as the
all-reduce (an all-reduce is a reduce-scatter plus an all-gather).

Every function takes `axis_name=None` for one device and is then the plain computation.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp  # noqa: F401 (the docstring examples use it)

from jaxcomm import comm
from jaxcomm.parallel._collective_matmul import _contract
from jaxcomm.parallel._collective_matmul import matmul_allgather_overlapped

SEQ_AXIS = 1  # activations are [batch, sequence, ...]


def dense_column(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                 n_in: int = 1) -> jax.Array:
  """Column-parallel dense: whole input, this device's slice of the output features.

  Args:
    x: f32[..., D] (its last `n_in` dimensions contract), the same on every tensor device.
    kernel: this device's columns, f32[D, F/T] (or f32[D, 3, H/T, Dh] for q, k, v).
    bias: this device's slice of the bias, or None.
    n_in: how many trailing dimensions of x contract with the kernel's leading ones.

  Returns:
    f32[..., F/T]: this device's output features (no communication).

  >>> dense_column(jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.zeros(4)).shape
  (2, 4)
  """
  y = _contract(x, kernel, n_in)
  return y if bias is None else y + bias


def dense_row(x_block: jax.Array, kernel: jax.Array, bias: jax.Array | None,
              axis_name: comm.AxisName, *, n_in: int = 1,
              sequence_parallel: bool = False) -> jax.Array:
  """Row-parallel dense: this device's input features times its rows, summed over devices.

  Args:
    x_block: f32[..., F/T], the output of a column-parallel layer.
    kernel: this device's rows, f32[F/T, D].
    bias: the whole bias f32[D] (added once, after the reduction), or None.
    axis_name: the tensor axis; None for one device.
    n_in: how many trailing dimensions of x contract with the kernel's leading ones.
    sequence_parallel: reduce-scatter along the sequence (dimension 1) instead of
      all-reducing: each device keeps its slice of the sequence.

  Returns:
    f32[..., D] summed over the tensor axis (f32[B, T/T_size, D] with sequence_parallel).

  >>> dense_row(jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.zeros(3), None)
  Array([[4., 4., 4.],
         [4., 4., 4.]], dtype=float32)
  """
  partial = _contract(x_block, kernel, n_in)
  if sequence_parallel:
    y, _ = comm.reduce_scatter(partial, axis_name, scatter_dimension=SEQ_AXIS)
  else:
    y, _ = comm.sum(partial, axis_name)
  return y if bias is None else y + bias


def _gather_sequence(x_block, axis_name):
  # Varying result: its transpose is the reduce-scatter Megatron-SP runs in the backward.
  x, _ = comm.all_gather(x_block, axis_name, axis=SEQ_AXIS, tiled=True, invariant=False)
  return x


def _column_in(x, kernel, bias, axis_name, sequence_parallel, collective_matmul, n_in=1):
  """The block's first matmul, gathering the sequence first (or overlapped) under SP."""
  if sequence_parallel and collective_matmul:
    y = matmul_allgather_overlapped(x, kernel, axis_name, gather_axis=SEQ_AXIS, n_in=n_in)
    return y if bias is None else y + bias
  if sequence_parallel:
    x = _gather_sequence(x, axis_name)
  return dense_column(x, kernel, bias, n_in=n_in)


def mlp_tp(x: jax.Array, fc_in: dict, fc_out: dict, axis_name: comm.AxisName, *,
           sequence_parallel: bool = False, collective_matmul: bool = False) -> jax.Array:
  """Transformer MLP, `gelu(x W1 + b1) W2 + b2`, with W1 split by columns and W2 by rows.

  Args:
    x: f32[B, T, D] (f32[B, T/T_size, D] with sequence_parallel).
    fc_in: `{"kernel": f32[D, F/T], "bias": f32[F/T]}`, this device's columns.
    fc_out: `{"kernel": f32[F/T, D], "bias": f32[D]}`, this device's rows, whole bias.
    axis_name: the tensor axis; None for one device.
    sequence_parallel: Megatron-SP (all-gather in, reduce-scatter out).
    collective_matmul: overlap the SP all-gather with the first matmul.

  Returns:
    Like x. One all-reduce (or all-gather + reduce-scatter) forward, one backward.

  >>> p_in = {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)}
  >>> p_out = {"kernel": jnp.ones((4, 3)), "bias": jnp.zeros(3)}
  >>> mlp_tp(jnp.ones((1, 2, 3)), p_in, p_out, None).shape
  (1, 2, 3)
  """
  h = _column_in(x, fc_in["kernel"], fc_in["bias"], axis_name, sequence_parallel,
                 collective_matmul)
  return dense_row(jax.nn.gelu(h), fc_out["kernel"], fc_out["bias"], axis_name,
                   sequence_parallel=sequence_parallel)


def attention_tp(x: jax.Array, qkv: dict, proj: dict, axis_name: comm.AxisName,
                 attention_fn: Callable, *, sequence_parallel: bool = False,
                 collective_matmul: bool = False) -> jax.Array:
  """Multi-head attention with the heads split over the tensor axis.

  Args:
    x: f32[B, T, D] (f32[B, T/T_size, D] with sequence_parallel).
    qkv: `{"kernel": f32[D, 3, H/T, Dh], "bias": f32[3, H/T, Dh]}`, this device's heads.
    proj: `{"kernel": f32[H/T, Dh, D], "bias": f32[D]}`, this device's heads, whole bias.
    axis_name: the tensor axis; None for one device.
    attention_fn: `(q, k, v) -> out`, all f32[B, T, H/T, Dh] (e.g. `causal_attention`).
    sequence_parallel: Megatron-SP (all-gather in, reduce-scatter out).
    collective_matmul: overlap the SP all-gather with the q, k, v projection.

  Returns:
    Like x. One all-reduce (or all-gather + reduce-scatter) forward, one backward.

  >>> from jaxcomm.parallel import causal_attention
  >>> qkv = {"kernel": jnp.ones((4, 3, 2, 2)), "bias": jnp.zeros((3, 2, 2))}
  >>> proj = {"kernel": jnp.ones((2, 2, 4)), "bias": jnp.zeros(4)}
  >>> attention_tp(jnp.ones((1, 3, 4)), qkv, proj, None, causal_attention).shape
  (1, 3, 4)
  """
  h = _column_in(x, qkv["kernel"], qkv["bias"], axis_name, sequence_parallel,
                 collective_matmul)
  out = attention_fn(h[:, :, 0], h[:, :, 1], h[:, :, 2])
  return dense_row(out, proj["kernel"], proj["bias"], axis_name, n_in=2,
                   sequence_parallel=sequence_parallel)
