"""SparseLoCo: DiLoCo whose outer gradient is chunked top-k, low-bit, with error feedback."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm, sync
from jaxcomm.local import _core
from jaxcomm.local import _diloco

BITS = (1, 2, 4, 8, None)


def _index_dtype(chunk: int):
  return jnp.uint8 if chunk <= 2**8 else jnp.uint16 if chunk <= 2**16 else jnp.uint32


def _pack(codes: jax.Array, bits: int) -> jax.Array:
  """u8[N] codes of `bits` bits -> u8[ceil(N*bits/8)], 8/bits codes per byte."""
  per = 8 // bits
  codes = jnp.pad(codes, (0, (-codes.shape[0]) % per)).reshape(-1, per).astype(jnp.uint32)
  return jnp.sum(codes << (bits * jnp.arange(per, dtype=jnp.uint32)), axis=1).astype(jnp.uint8)


def _unpack(packed: jax.Array, bits: int, count: int) -> jax.Array:
  per = 8 // bits
  shifts = bits * jnp.arange(per, dtype=jnp.uint8)
  return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count]


def topk_chunks(density: float, bits: int | None = 2, chunk: int = 4096) -> codecs.Codec:
  """Top-k by magnitude in every chunk of `chunk` elements, values quantised to `bits` bits.

  Payload: indices within the chunk (u8/u16), values as packed `bits`-bit codes of a
  symmetric uniform grid over [-s, s] with s = max |kept value| of the chunk (2**bits
  levels, round to nearest), and s in float32 per chunk; with `bits=None` the values travel
  as float32. Supports differ between workers, so the codec is not linear: it travels by
  gather. Deterministic (the error memory absorbs the rounding bias).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> codec = topk_chunks(0.25, bits=2, chunk=8)
    >>> x = jnp.array([0.1, -4.0, 0.2, 0.0, 3.0, 0.1, -0.1, 0.0])
    >>> codec.decode(codec.encode(x, jax.random.key(0)), 8).tolist()  # 2 largest, 2-bit grid
    [0.0, -4.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0]
  """
  density = v.number("density", density, low=0.0, high=1.0, low_open=True)
  bits = v.one_of("bits", bits, BITS)
  chunk = v.integer("chunk", chunk, low=1, high=2**32)
  name = f"topk_chunks({density}, bits={bits}, chunk={chunk})"

  def shape(n):
    c = min(chunk, n)
    return c, -(-n // c), max(1, min(c, int(round(density * c))))  # chunk, chunks, k

  def encode(x, key):
    del key
    c, m, k = shape(x.shape[0])
    xs = jnp.pad(x, (0, m * c - x.shape[0])).reshape(m, c)
    _, idx = lax.top_k(jnp.abs(xs), k)
    vals = jnp.take_along_axis(xs, idx, axis=1)
    idx = idx.astype(_index_dtype(c))
    if bits is None:
      return idx, vals.astype(jnp.float32)
    scale = jnp.max(jnp.abs(vals), axis=1)
    levels = (1 << bits) - 1
    unit = vals / jnp.where(scale > 0, scale, 1.0)[:, None]
    codes = jnp.clip(jnp.round((unit + 1.0) * 0.5 * levels), 0, levels).astype(jnp.uint8)
    return idx, _pack(codes.reshape(-1), bits), scale.astype(jnp.float32)

  def decode(payload, n):
    c, m, k = shape(n)
    idx = payload[0].astype(jnp.int32)
    if bits is None:
      vals = payload[1]
    else:
      levels = (1 << bits) - 1
      codes = _unpack(payload[1], bits, m * k).reshape(m, k).astype(jnp.float32)
      vals = (codes / levels * 2.0 - 1.0) * payload[2][:, None]
    out = jnp.zeros((m, c), jnp.float32).at[jnp.arange(m)[:, None], idx].set(vals)
    return out.reshape(-1)[:n]

  def payload_bytes(n):
    c, m, k = shape(n)
    index = m * k * jnp.dtype(_index_dtype(c)).itemsize
    if bits is None:
      return index + 4 * m * k
    return index + math.ceil(m * k * bits / 8) + 4 * m

  return codecs.Codec(name, encode=encode, decode=decode, payload_bytes=payload_bytes,
                      linear=False)


def sparseloco(inner: optax.GradientTransformation, sync_every: int, density: float = 0.02,
               bits: int | None = 2, axis_name: comm.AxisName = "data", *,
               chunk: int = 4096, decay: float = 0.95, outer_lr: float = 1.0,
               participation: _core.Participation = None) -> optax.GradientTransformationExtraArgs:
  """SparseLoCo: H inner steps, then a sparse, low-bit outer gradient with error feedback.

  After H inner steps worker w has Δ_w = θ − θ_w; its error memory becomes
  e_w ← β e_w + Δ_w; it sends s_w = Q(top_k_chunk(e_w)) and keeps e_w ← e_w − D(s_w);
  every worker applies θ ← θ − α mean_w D(s_w) and restarts from θ. The payloads' supports
  differ between workers, so they are all-gathered and decoded (wire bytes
  (W − 1) × payload per sync). There is no outer momentum: the decaying memory takes its
  place. Defaults (β = 0.95, α = 1, 2-bit values, density 2 %, chunks of 4096) are our
  reading of the paper, *unverified*. Sharded parameters (`parallel.Layout.optimizer`):
  per shard, the top-k chunks are cut from this device's shards.

  Args:
    inner: the optimiser each worker runs (AdamW in the paper).
    sync_every: H >= 1.
    density: fraction of each chunk kept, in (0, 1].
    bits: bits per kept value, one of 1, 2, 4, 8, or None for float32 values.
    axis_name: the mesh axis (or tuple of axes) of the workers; None for one device.
    chunk: elements per top-k chunk (>= 1).
    decay: β in [0, 1], the error memory's decay.
    outer_lr: α > 0, the outer step size.
    participation: optional live-worker mask per sync (see `diloco`).

  Returns:
    An `optax.GradientTransformationExtraArgs` (its state is a `DilocoState` whose outer
    optimiser is SGD(α)) that needs `params` in `update`.

  References:
    SparseLoCo, arXiv 2508.15706.

  >>> import jax.numpy as jnp, optax
  >>> tx = sparseloco(optax.sgd(0.1), sync_every=1, density=0.5, bits=None, axis_name=None)
  >>> params = {"w": jnp.array([1.0, 1.0, 1.0, 1.0])}
  >>> updates, state = tx.update({"w": jnp.array([4.0, 1.0, 3.0, 2.0])}, tx.init(params),
  ...                            params)
  >>> optax.apply_updates(params, updates)["w"]
  Array([0.6, 1. , 0.7, 1. ], dtype=float32)
  """
  inner, sync_every, axis_name, live_fn = _core.schedule_args(inner, sync_every, axis_name,
                                                              participation)
  decay = v.number("decay", decay, low=0.0, high=1.0)
  outer_lr = v.number("outer_lr", outer_lr, low=0.0, low_open=True)
  return _diloco.build(inner, optax.sgd(outer_lr), sync_every, axis_name,
                       codec=topk_chunks(density, bits, chunk),
                       memory=sync.error_feedback(decay=decay),
                       live_fn=live_fn, key=v.key("key", None), name="sparseloco")
