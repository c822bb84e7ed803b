"""A reduce-scatter whose payload travels encoded by any codec.

Device r must end with the float32 sum over the axis of chunk r of every device's vector.
Each device splits its vector into W chunks, encodes each chunk with the codec, and one
`all_to_all` sends chunk j's payload to device j; device r decodes the W payloads it received
and sums them in float32. The sum is taken after decoding, so this is exact for every codec,
linear or not (top-k, int-N with per-chunk scales, sign, ...): it is phase one of the two-phase
compressed all-reduce (ALGORITHMS.md), and the reduce-scatter of compressed ZeRO.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm.codecs import Codec
from jaxcomm.comm import _collectives as col


def _encode_chunks(codec: Codec, chunks: jax.Array, key: Any) -> tuple:
  """Encodes each row of `chunks` f32[W, m] on its own; payload leaves gain a leading W."""
  if key is None:
    return jax.vmap(lambda c: codec.encode(c, None))(chunks)
  keys = jax.random.split(key, chunks.shape[0])
  return jax.vmap(codec.encode)(chunks, keys)


def _decode_chunks(codec: Codec, payload: tuple, m: int) -> jax.Array:
  """Decodes a payload with a leading chunk axis into f32[W, m]."""
  return jax.vmap(lambda p: codec.decode(p, m))(payload)


def reduce_scatter_encoded(vec: jax.Array, axis_name: col.AxisName, codec: Codec,
                           key: Any = None) -> tuple[jax.Array, jax.Array, float]:
  """Sum of `vec` over `axis_name`, scattered: device r keeps chunk r, the payload encoded.

  Args:
    vec: f32[n] on each device, n a multiple of W (pad first: the padding travels too).
    axis_name: the mesh axis (or tuple of axes); None means one device (no wire, but the
      chunk still goes through encode and decode, so one device sees what W would).
    codec: any `jaxcomm.codecs.Codec`; its payload leaves travel as they are (narrow floats
      as their bit patterns, which XLA:CPU would otherwise widen to float32).
    key: PRNG key for stochastic codecs, split into one key per chunk; ignored otherwise.

  Returns:
    `(shard, sent, wire_bytes)`: shard f32[n/W] is this device's chunk of the float32 sum of
    the decoded payloads; sent f32[n] is what this device's own payloads decode to (for error
    feedback: memory = input - sent); wire_bytes = (W-1)/W * W * payload_bytes(n/W), the
    all-to-all of the encoded chunks.

  >>> from jaxcomm import codecs
  >>> shard, sent, nbytes = reduce_scatter_encoded(jnp.arange(4.0), None, codecs.cast("bfloat16"))
  >>> shard, nbytes
  (Array([0., 1., 2., 3.], dtype=float32), 0.0)
  """
  axes = col._axes(axis_name)  # pylint: disable=protected-access
  w = col.axis_size(axes) if axes else 1
  n = vec.shape[0]
  if n % w:
    raise ValueError(f"the vector length ({n}) must be a multiple of the axis size ({w}); "
                     "pad it first.")
  if codec.stochastic and key is None:
    raise ValueError(f"codec {codec.name!r} is stochastic and needs a PRNG key.")
  m = n // w
  chunks = vec.astype(jnp.float32).reshape(w, m)
  payload = _encode_chunks(codec, chunks, key if codec.stochastic else None)
  sent = _decode_chunks(codec, payload, m).reshape(n)
  if not axes:
    return sent, sent, 0.0
  dtypes = [x.dtype for x in jax.tree.leaves(payload)]
  bits = jax.tree.map(col.to_bits, payload)
  received, nbytes = col.all_to_all(bits, axes, split_axis=0, concat_axis=0)
  leaves, treedef = jax.tree.flatten(received)
  received = jax.tree.unflatten(treedef, [col.from_bits(x, d) for x, d in zip(leaves, dtypes)])
  # Row j of every received leaf came from device j: decode each, sum in float32.
  shard = jnp.sum(_decode_chunks(codec, received, m), axis=0)
  return shard, sent, nbytes
