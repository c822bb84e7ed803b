"""How a compressed outer gradient travels: the one place schedules meet codecs.

`codec_sum` sends every worker's encoded vector and returns the decoded sum over the live
workers. Linear codecs (identity, cast, shared-seed random-k) have summable payloads: float32
leaves are all-reduced with psum, narrower float leaves travel as their bits through the
two-phase reduction (all-to-all, float32 sum, all-gather), so every byte on the wire really
is the narrow type. Every other codec travels by gather: all-gather the payloads, decode
each worker's, sum in float32 (docs/algorithms.md, "How a payload is summed").

Non-linear codecs that need the two-phase compressed all-reduce with re-encoding (issue 3,
`jaxcomm.comm`/`jaxcomm.sync`) plug in here, in `_nonlinear_sum`, and nowhere else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm import codecs, comm
from jaxcomm.local import _core


def _narrow_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4


def _linear_sum(payload: tuple, axis_name) -> tuple[tuple, float]:
  """Sum of linear payloads over the axis, each leaf in its own wire type."""
  out, nbytes = [], 0.0
  for leaf in payload:
    if _narrow_float(leaf):
      flat, sent = comm.two_phase_sum(leaf.reshape(-1), axis_name, leaf.dtype)
      out.append(flat.reshape(leaf.shape))
    else:
      total, sent = comm.sum(leaf, axis_name)
      out.append(total)
    nbytes += sent
  return tuple(out), nbytes


def _nonlinear_sum(codec: codecs.Codec, payload: tuple, n: int, row: jax.Array,
                   axis_name) -> tuple[jax.Array, float]:
  """Gather transport: all-gather the payloads, decode each, weighted sum in float32.

  This is the single function to replace by the two-phase compressed all-reduce.
  """
  bits = tuple(comm.to_bits(p) if _narrow_float(p) else p for p in payload)
  gathered, nbytes = comm.all_gather(bits, axis_name)
  gathered = tuple(comm.from_bits(g, p.dtype) if _narrow_float(p) else g
                   for g, p in zip(gathered, payload))
  decoded = jax.vmap(lambda *p: codec.decode(tuple(p), n))(*gathered)  # f32[W, n]
  return jnp.einsum("w,wn->n", row, decoded.astype(jnp.float32)), nbytes


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
    `(total f32[n], own f32[n], wire bytes)`: own is this worker's decoded payload, what an
    error memory subtracts.
  """
  n = vec.shape[0]
  if not codec.linear:
    key = jax.random.fold_in(key, _core.worker_index(axis_name))
  payload = tuple(codec.encode(vec, key))
  own = codec.decode(payload, n).astype(jnp.float32)
  if not _core.axes_of(axis_name):
    return own * mine, own, 0.0
  if codec.linear:
    masked = tuple(p * mine.astype(p.dtype) for p in payload)
    summed, nbytes = _linear_sum(masked, axis_name)
    return codec.decode(summed, n).astype(jnp.float32), own, nbytes
  total, nbytes = _nonlinear_sum(codec, payload, n, row, axis_name)
  return total, own, nbytes


def check_codec(codec, name: str = "codec"):
  if codec is not None and not isinstance(codec, codecs.Codec):
    raise ValueError(f"{name} must be a jaxcomm.codecs.Codec (e.g. codecs.identity(), "
                     f"codecs.cast('bfloat16')) or None, got {codec!r}.")
  return codec
