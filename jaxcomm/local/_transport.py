"""How a compressed outer gradient travels: the one place schedules meet codecs.

`codec_sum` sends every worker's encoded vector and returns the decoded sum over the live
workers, through `jaxcomm.comm`'s compressed sums. Linear codecs (identity, cast, shared-key
random-k) have summable payloads: a dropped worker sends the code of zeros; float32 payloads
are all-reduced (`psum`), narrower float payloads travel as their bits through the two-phase
reduction (all-to-all, float32 sum, all-gather), so every byte on the wire really is the
narrow type. Every other codec travels by gather: all-gather the payloads, decode each
worker's, sum in float32 weighted by the live mask (docs/algorithms.md, "How a payload is
summed").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm import codecs, comm
from jaxcomm.local import _core


def _linear_collective(codec: codecs.Codec, vec: jax.Array, key: jax.Array) -> str:
  """psum for float32 payloads; two-phase for narrower floats (XLA:CPU widens their psum)."""
  payload = jax.eval_shape(codec.encode, vec, key)
  narrow = any(jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4
               for x in jax.tree.leaves(payload))
  return "two_phase" if narrow else "psum"


def codec_sum(codec: codecs.Codec, vec: jax.Array, key: jax.Array, mine: jax.Array,
              row: jax.Array, axis_name) -> tuple[jax.Array, jax.Array, float]:
  """Sends `codec(vec)` from every worker; returns (sum of live decodes, own decode, bytes).

  Args:
    codec: the codec of the payload.
    vec: f32[n], this worker's vector.
    key: PRNG key shared by all workers (stochastic codecs; the shared key is what makes
      random-k linear). Non-linear codecs get a per-worker key folded from it.
    mine: f32[], this worker's live weight (0 or 1); row: f32[W], every worker's.
    axis_name: the axis to sum over; None for one device.

  Returns:
    `(total f32[n], own f32[n], wire bytes)`: own is this worker's decoded payload (what an
    error memory subtracts), valid when the worker is live.
  """
  key = key if codec.stochastic else None
  if codec.linear:  # The code of mine * vec is mine * the code of vec (mine is 0 or 1).
    out, nbytes = comm.compressed_sum(vec * mine, codec, axis_name,
                                      _linear_collective(codec, vec, key), key=key)
  else:
    if key is not None:
      key = jax.random.fold_in(key, _core.worker_index(axis_name))
    out, nbytes = comm.compressed_sum(vec, codec, axis_name, "gather", key=key, weights=row)
  return out.total, out.own, nbytes


def check_codec(codec, name: str = "codec"):
  """None, a `Codec` or a factory `shapes -> Codec` (ValueError naming `name` otherwise)."""
  return codecs.validate(codec, name, allow_none=True)
