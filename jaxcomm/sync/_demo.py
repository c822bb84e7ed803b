"""DeMo: decoupled momentum; only the fast DCT components of the momentum travel."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm


class DemoState(NamedTuple):
  """State of `demo`."""
  count: jax.Array       # int32[]: updates done
  delta: jax.Array       # f32[n], per worker: local momentum minus what it already sent
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent by this device (mod 2**32)


def _codec(params, chunk: int, k: int) -> codecs.Codec:
  """DeMo's per-tensor codec for this tree (a shape-aware codec: `codecs.for_tree`)."""
  return codecs.for_tree(functools.partial(codecs.tiled_dct_top_k, chunk=chunk, k=k), params)


def demo_bytes(params, w: int, chunk: int = 64, k: int = 32) -> float:
  """Wire bytes per device of one step: all-gather of k (value, index) pairs per tile.

  Args:
    params: the parameters (arrays or `jax.ShapeDtypeStruct`s): only shapes are read.
    w: workers.
    chunk: the largest tile side.
    k: coefficients sent per tile.

  Example:
    >>> demo_bytes({"w": jnp.zeros((128, 64))}, 8)  # 2 tiles of 64 x 64, 32 (f32, u16) each
    2688.0
  """
  n = sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(params))
  return comm.compressed_bytes(_codec(params, chunk, k), n, w, "gather")


def demo(learning_rate: float | optax.Schedule, beta: float = 0.999, chunk: int = 64,
         k: int = 32, weight_decay: float = 0.0,
         axis_name: comm.AxisName = "data") -> optax.GradientTransformationExtraArgs:
  """DeMo: each worker keeps its own momentum and sends only its top DCT components.

  Per update, on worker w with local gradient g_w: delta <- beta delta + lr g_w; q = the k
  largest DCT-II coefficients of every tile of delta, DeMo's transform
  (`codecs.tiled_dct_top_k`: per tensor, each dimension split into chunks of its largest
  divisor <= `chunk`, a 2-D DCT per tile of a matrix, 1-D per chunk of a vector);
  delta <- delta - D(q) (the momentum is the error memory); all-gather every worker's
  (value, index) pairs, decode each and average; the update is -lr sign(mean) - lr wd theta
  (decoupled weight decay). Wire format: k float32 values and tile-local indices (uint16
  for 64 x 64 tiles) per tile, from all W workers: (W - 1) x that per device.

  Sharded gradients (`parallel.Layout.optimizer`): per shard; the tiles are cut from this
  device's shard of each tensor (chunks divide the shard's dimensions), so no tile
  straddles two devices and nothing travels but the replicas' payloads.

  Args:
    learning_rate: a float or an optax schedule of the update count.
    beta: momentum decay in [0, 1) (DeMo: 0.999).
    chunk: the largest tile side, >= 1 (DeMo: 64).
    k: coefficients sent per tile, 1..chunk**2 (DeMo: 32); a tile smaller than k sends all
      of its coefficients.
    weight_decay: decoupled weight decay, >= 0 (needs `params` in update).
    axis_name: the data axis; None for one device.

  Returns:
    An `optax.GradientTransformationExtraArgs` (a complete optimiser: do not chain another)
    whose state keeps the per-worker momentum and the wire bytes.

  References:
    Peng, Quesnelle, Kingma, DeMo: Decoupled Momentum Optimization, arXiv 2411.19870.

  >>> import jax.numpy as jnp
  >>> tx = demo(0.1, beta=0.0, chunk=4, k=4, axis_name=None)
  >>> g = {"w": jnp.array([1., -2., 0.5, -0.1])}
  >>> updates, state = tx.update(g, tx.init(g), g)
  >>> updates["w"]
  Array([-0.1,  0.1, -0.1,  0.1], dtype=float32)
  """
  chunk = v.integer("chunk", chunk, low=1)
  k = v.integer("k", k, low=1)
  if k > chunk * chunk:  # a tile has chunk**2 components
    raise ValueError(f"k must be at most chunk**2 ({chunk * chunk}), got {k}.")
  beta = v.number("beta", beta, low=0.0, high=1.0, high_open=True)
  weight_decay = v.number("weight_decay", weight_decay, low=0.0)
  lr = learning_rate if callable(learning_rate) else (lambda _: learning_rate)

  def init_fn(params):
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    return DemoState(count=jnp.zeros((), jnp.int32), delta=jnp.zeros((n,), jnp.float32),
                     wire_bytes=comm.zero_bytes())

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axis_name, "sync.demo")
    del extra_args
    g, unflatten = codecs.flatten(updates)
    rate = lr(state.count)
    delta = beta * state.delta + rate * g
    out, nbytes = comm.compressed_sum(delta, _codec(updates, chunk, k), axis_name, "gather")
    step = -rate * jnp.sign(out.total / comm.axis_size(axis_name))
    if weight_decay:
      if params is None:
        raise ValueError("demo with weight_decay > 0 needs params in update().")
      step = step - rate * weight_decay * codecs.flatten(params)[0]
    new_state = DemoState(count=state.count + 1, delta=delta - out.own,
                          wire_bytes=comm.add_bytes(state.wire_bytes, nbytes))
    return unflatten(step), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
