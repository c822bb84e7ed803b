"""ZeRO-3 / FSDP layers: parameters stored sharded, gathered for one layer at a time.

`fsdp(fn, specs, axis_name)` wraps a layer `fn(params, *inputs)` so that it takes this
device's parameter shards. Forward: all-gather the shards, run the layer, keep only the
shards and the inputs. Backward: all-gather the shards *again*, recompute the layer and its
vjp, and reduce-scatter the parameter cotangents back to shards. So the gathered parameters
of a layer live only while that layer runs, the standard FSDP schedule (arXiv 1910.02054,
stage 3): per step, two all-gathers and one reduce-scatter of every sharded parameter,
3(W-1)/W |theta| bytes, 1.5x a data-parallel all-reduce.

The wrapper is a `custom_vjp` rather than `jax.checkpoint`: XLA:CPU's common-subexpression
pass merges a rematerialised all-gather with the forward one (it drops the optimisation
barrier that should separate them), which would keep every gathered parameter alive from
forward to backward. The backward gather also travels as the parameters' bit pattern
(same bytes), which no pass can merge with the forward gather.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm import comm


def gather_dims(spec: P, axes: tuple) -> tuple:
  """`((dim, mesh axes), ...)`: the dimensions of one array sharded over any of `axes`."""
  out = []
  for dim, entry in enumerate(spec):
    names = comm.axis_names(entry)
    hit = tuple(a for a in names if a in axes)
    if hit and len(hit) != len(names):
      raise ValueError(f"dimension {dim} of spec {spec} mixes gathered axes {hit} with "
                       f"others {tuple(a for a in names if a not in axes)}; shard a dimension "
                       "over one kind of axis.")
    if hit:
      out.append((dim, hit))
  return tuple(out)


def _gather(params, dims, as_bits: bool, keep=None):
  """Gathers each shard along its sharded dims; leaves not in `keep` become zeros."""
  def one(x, pairs, kept):
    if not kept:  # Its value is not read: a placeholder of the gathered shape, no traffic.
      shape = list(x.shape)
      for dim, axes in pairs:
        shape[dim] *= comm.axis_size(axes)
      return comm.varying(jnp.zeros(shape, x.dtype), tuple(comm.varying_axes(x)))
    for dim, axes in pairs:
      if as_bits:
        y, _ = comm.all_gather(comm.to_bits(x), axes, axis=dim, tiled=True, invariant=False)
        x = comm.from_bits(y, x.dtype)
      else:
        x, _ = comm.all_gather(x, axes, axis=dim, tiled=True, invariant=False)
    return x
  keep = [True] * len(params) if keep is None else keep
  return [one(x, pairs, kept) for x, pairs, kept in zip(params, dims, keep)]


def _scatter(cts, dims):
  def one(ct, pairs):
    for dim, axes in reversed(pairs):
      ct, _ = comm.reduce_scatter(ct, axes, scatter_dimension=dim)
    return ct
  return [one(ct, pairs) for ct, pairs in zip(cts, dims)]


def _tie(leaves, dims, anchor):
  """Ties each gathered shard to a cotangent so the re-gather cannot be hoisted forward.

  An optimisation barrier makes its operands vary over the union of their axes, so a shard
  is tied only when the anchor varies over no axis the shard does not.
  """
  out = []
  for x, pairs in zip(leaves, dims):
    if pairs and comm.varying_axes(anchor) <= comm.varying_axes(x):
      x, _ = lax.optimization_barrier((x, anchor))
    out.append(x)
  return out


def fsdp(fn: Callable, specs: Any, axis_name: comm.AxisName,
         regather: Any = None) -> Callable:
  """Wraps `fn(params, *inputs)` to take parameter shards, gathered per call (ZeRO-3).

  Args:
    fn: a layer, `fn(params, *inputs) -> outputs`, written for whole parameters.
    specs: PartitionSpecs of `params` (a tree like it); dimensions sharded over
      `axis_name` are gathered, other dimensions (e.g. over `tensor`) are left alone.
    axis_name: the mesh axis (or tuple of axes) parameters are stored sharded over; None
      (or no leaf sharded over it) returns `fn` unchanged.
    regather: optional tree of bools like `params`: False for a parameter whose value no
      gradient of the layer reads (an embedding table, a bias added last); it is not
      gathered again in the backward pass. Default: every sharded parameter is.

  Returns:
    `layer(param_shards, *inputs)`. Its gradient with respect to a shard is the sum over
    `axis_name` of every device's gradient of that shard (a reduce-scatter): the caller's
    optimiser divides by the axis size for a mean (see `zero(stage=3)`). Leaves not
    sharded over `axis_name` get their local gradient.

  >>> layer = fsdp(lambda p, x: x @ p["w"], {"w": P("fsdp")}, None)
  >>> layer({"w": jnp.eye(2)}, jnp.ones(2))
  Array([1., 1.], dtype=float32)
  """
  axes = comm.axis_names(axis_name)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  dims = [gather_dims(s, axes) for s in spec_leaves]
  if not axes or not any(dims):
    return fn
  keep = [True] * len(dims) if regather is None else [bool(r) for r in jax.tree.leaves(regather)]

  def whole(shards):
    leaves, treedef = jax.tree.flatten(shards)
    if len(leaves) != len(dims):
      raise ValueError(f"fsdp: {len(leaves)} parameter leaves but {len(dims)} specs.")
    return leaves, treedef

  @jax.custom_vjp
  def layer(shards, *inputs):
    leaves, treedef = whole(shards)
    return fn(jax.tree.unflatten(treedef, _gather(leaves, dims, False)), *inputs)

  def layer_fwd(shards, *inputs):
    return layer(shards, *inputs), (shards, inputs)

  def layer_bwd(res, ct):
    shards, inputs = res
    leaves, treedef = whole(shards)
    leaves = _tie(leaves, dims, jax.tree.leaves(ct)[0])
    params = jax.tree.unflatten(treedef, _gather(leaves, dims, True, keep))
    _, vjp = jax.vjp(fn, params, *inputs)
    d_params, *d_inputs = vjp(ct)
    d_leaves = _scatter(jax.tree.leaves(d_params), dims)
    return (jax.tree.unflatten(treedef, d_leaves), *d_inputs)

  layer.defvjp(layer_fwd, layer_bwd)
  return layer
