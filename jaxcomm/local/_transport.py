"""How a compressed outer gradient travels: the one place schedules meet codecs.

`codec_sum` sends every worker's encoded vector and returns the decoded sum over the live
workers, through `jaxcomm.comm`'s compressed sums. Linear codecs (identity, cast, shared-key
random-k) have summable payloads: a dropped worker sends the code of zeros; float32 payloads
are all-reduced (`psum`), narrower float payloads travel as their bits through the two-phase
reduction (all-to-all, float32 sum, all-gather), so every byte on the wire really is the
narrow type. Every other codec travels by gather: all-gather the payloads, decode each
worker's, sum in float32 weighted by the live mask (docs/algorithms.md, "How a payload is
summed"), unless the schedule asks for the two-phase reduction (`collective="two_phase"`):
each worker sends 2(W-1)/W of a payload instead of receiving W-1 payloads, at the price of a
second encoding (the owner of each chunk re-encodes the sum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm import _validate as v
from jaxcomm import codecs, comm
from jaxcomm.local import _core

# How a codec's payloads travel: None (linear codecs summed in their wire type, others
# gathered), "gather" (every payload to every worker, decoded one by one) or "two_phase".
COLLECTIVES = (None, "gather", "two_phase")


def _linear_collective(codec: codecs.Codec, vec: jax.Array, key: jax.Array) -> str:
  """psum for float32 payloads; two-phase for narrower floats (XLA:CPU widens their psum)."""
  payload = jax.eval_shape(codec.encode, vec, key)
  narrow = any(jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4
               for x in jax.tree.leaves(payload))
  return "two_phase" if narrow else "psum"


def codec_sum(codec: codecs.Codec, vec: jax.Array, key: jax.Array, mine: jax.Array,
              row: jax.Array, axis_name, collective: str | None = None
              ) -> tuple[jax.Array, jax.Array, float]:
  """Sends `codec(vec)` from every worker; returns (sum of live decodes, own decode, bytes).

  Args:
    codec: the codec of the payload.
    vec: f32[n], this worker's vector.
    key: PRNG key shared by all workers (stochastic codecs; the shared key is what makes
      random-k linear). Non-linear codecs get a per-worker key folded from it.
    mine: f32[], this worker's live weight (0 or 1); row: f32[W], every worker's.
    axis_name: the axis to sum over; None for one device.
    collective: one of `COLLECTIVES` (checked by `check_collective`).

  Returns:
    `(total f32[n], own f32[n], wire bytes)`: own is this worker's decoded payload (what an
    error memory subtracts), valid when the worker is live.
  """
  key = key if codec.stochastic else None
  if collective is None and codec.linear:
    # The code of mine * vec is mine * the code of vec (mine is 0 or 1).
    out, nbytes = comm.compressed_sum(vec * mine, codec, axis_name,
                                      _linear_collective(codec, vec, key), key=key)
    return out.total, out.own, nbytes
  if key is not None and not codec.shared_key:
    key = jax.random.fold_in(key, _core.worker_index(axis_name))
  if collective == "two_phase":
    # A dropped worker sends the code of zeros, which decodes to zeros.
    out, nbytes = comm.compressed_sum(vec * mine, codec, axis_name, "two_phase", key=key)
  else:
    out, nbytes = comm.compressed_sum(vec, codec, axis_name, "gather", key=key, weights=row)
  return out.total, out.own, nbytes


def check_collective(collective, codec) -> str | None:
  """`collective` checked against the (already checked) codec: a ValueError naming it."""
  collective = v.one_of("collective", collective, COLLECTIVES)
  if collective is not None and codec is None:
    raise ValueError(f"collective={collective!r} needs a codec (without one the outer "
                     f"gradient is all-reduced in float32).")
  if collective == "two_phase" and not codecs.splittable(codec):
    raise ValueError(f"collective='two_phase' encodes 1/W chunks of the vector, but codec "
                     f"{getattr(codec, 'name', codec)!r} needs the whole vector (it is built "
                     f"for one length or for the parameters' shapes); use collective='gather' "
                     f"or None.")
  return collective


def check_codec(codec, name: str = "codec"):
  """None, a `Codec` or a factory `shapes -> Codec` (ValueError naming `name` otherwise)."""
  return codecs.validate(codec, name, allow_none=True)
