"""The `Codec` record and the exact codecs (identity, cast). The contract every codec keeps
is written in `jaxcomm.codecs`'s module docstring."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxcomm.codecs import _validate

Payload = tuple


@dataclasses.dataclass(frozen=True)
class Codec:
  """An encode/decode pair with its exact payload size (the contract: `help(jaxcomm.codecs)`).

  Attributes:
    name: how the codec shows up in tables and error messages.
    encode: `(x f32[n], key) -> payload`, a tuple of arrays in wire dtypes whose shapes
      depend on n only; `key` is a PRNG key for stochastic codecs, None otherwise.
    decode: `(payload, n) -> f32[n]`; `(payload, n, key)` for shared-key codecs.
    payload_bytes: `n -> int`, the exact bytes of `encode`'s payload for n elements.
    linear: decode(sum of payloads) = sum of decodes, so payloads may be psum'd.
    stochastic: `encode` draws random numbers from `key` (others get key=None).
    error_bound: `x -> f32[]`, an upper bound on max |decode(encode(x)) - x|; None means
      the codec is exact.
    shared_key: `decode` needs the encoder's key, the same on every worker.
    unbiased: E_key decode(encode(x)) = x.
    variance_bound: `x -> f32[]`, an upper bound on E_key ||decode(encode(x)) - x||^2.
    collective: how a non-linear codec prefers to travel: "gather" or "two_phase".
    length: the one vector length the codec accepts (a per-tensor codec built for a
      parameter tree's shapes); such a codec needs the whole vector, so collectives that
      split it (two-phase, hierarchical axes, ZeRO's reduce-scatter) refuse it.
    decode_sum: optional `(payloads, n) -> f32[n]`, the sum of the decodes of W payloads
      stacked on a leading axis in one pass (sparse codecs scatter-add every pair; a
      transform is inverted once, not W times); `decode_sum_with` falls back to a loop.

  A codec of your own (`jaxcomm.testing.check_codec` holds it to the contract):

  >>> import jax.numpy as jnp
  >>> from jaxcomm import codecs
  >>> halves = codecs.Codec(
  ...     "my_bf16", encode=lambda x, key: (x.astype(jnp.bfloat16),),
  ...     decode=lambda p, n: p[0].astype(jnp.float32), payload_bytes=lambda n: 2 * n,
  ...     error_bound=lambda x: jnp.max(jnp.abs(x)) * 2.0 ** -8)
  >>> halves.roundtrip(jnp.array([1.0, 3.0])), halves.payload_bytes(2)
  (Array([1., 3.], dtype=float32), 4)
  """
  name: str
  encode: Callable[[jax.Array, Any], Payload]   # (f32[n], key) -> payload
  decode: Callable[..., jax.Array]              # (payload, n[, key]) -> f32[n]
  payload_bytes: Callable[[int], int]           # n -> exact bytes of encode's output
  linear: bool = False
  stochastic: bool = False
  error_bound: Callable[[jax.Array], jax.Array] | None = None  # x -> max |x - D(C(x))|
  shared_key: bool = False     # decode needs the encoder's key (the same on every worker)
  unbiased: bool = False       # E_key D(C(x)) = x
  variance_bound: Callable[[jax.Array], jax.Array] | None = None  # x -> >= E||D(C(x))-x||^2
  collective: str = "gather"   # preferred collective when not linear: gather | two_phase
  length: int | None = None    # the only n it accepts; needs the whole vector (no splitting)
  decode_sum: Callable[[Payload, int], jax.Array] | None = None  # ([W, ..], n) -> f32[n]

  def decode_sum_with(self, payloads: Payload, n: int) -> jax.Array:
    """Sum of `decode(payload_w, n)` over the leading axis of `payloads` (not shared-key).

    >>> c = identity()
    >>> c.decode_sum_with((jnp.ones((3, 2)),), 2)
    Array([3., 3.], dtype=float32)
    """
    if self.decode_sum is not None:
      return self.decode_sum(payloads, n)
    pick = lambda i: jax.tree.map(lambda x: x[i], payloads)
    first = self.decode(pick(0), n).astype(jnp.float32)
    w = jax.tree.leaves(payloads)[0].shape[0]
    return jax.lax.fori_loop(1, w, lambda i, acc: acc + self.decode(pick(i), n).astype(
        jnp.float32), first)

  def decode_with(self, payload: Payload, n: int, key: Any = None) -> jax.Array:
    """decode(payload, n), passing `key` only to codecs whose decode needs it."""
    if self.shared_key:
      return self.decode(payload, n, key)
    return self.decode(payload, n)

  def roundtrip(self, x: jax.Array, key: Any = None) -> jax.Array:
    """decode(encode(x)): what the receiver reconstructs."""
    return self.decode_with(self.encode(x, key), x.shape[0], key)

  def ratio(self, n: int) -> float:
    """Compression ratio against float32 for a vector of n elements."""
    return 4.0 * n / self.payload_bytes(n)


def identity() -> Codec:
  """Sends float32 as is: the exact reference every codec is held against.

  >>> c = identity()
  >>> c.roundtrip(jnp.arange(3.0)), c.payload_bytes(3), c.linear
  (Array([0., 1., 2.], dtype=float32), 12, True)
  """
  return Codec("identity", encode=lambda x, key: (x.astype(jnp.float32),),
               decode=lambda p, n: p[0], payload_bytes=lambda n: 4 * n, linear=True,
               error_bound=lambda x: jnp.zeros((), jnp.float32))


_CAST_DTYPES = {
    "float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
    "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2,
}


def cast(dtype: Any = jnp.bfloat16) -> Codec:
  """Round to a narrower float (bf16, fp16, fp8 e4m3/e5m2); linear up to rounding.

  Summing cast payloads is exact in the wide accumulator, so the codec is linear; its
  payload is the narrow float's bit pattern. fp8 without scales overflows past the format's
  largest value (448 for e4m3fn); `jaxcomm.codecs.fp8` adds per-block scales.

  >>> c = cast("bfloat16")
  >>> c.payload_bytes(10), c.linear
  (20, True)
  """
  name = _validate.cast_dtype(dtype, _CAST_DTYPES)
  dt = jnp.dtype(_CAST_DTYPES[name])
  eps, fmax = float(jnp.finfo(dt).eps), float(jnp.finfo(dt).max)

  def error_bound(x):
    amax = jnp.max(jnp.abs(x))
    return jnp.where(amax <= fmax, amax * eps, jnp.inf)

  return Codec(f"cast({name})", encode=lambda x, key: (x.astype(dt),),
               decode=lambda p, n: p[0].astype(jnp.float32),
               payload_bytes=lambda n: dt.itemsize * n, linear=True,
               error_bound=error_bound)


def flatten(tree: Any) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
  """One float32 vector from a tree, and the function that puts a vector back.

  Example:
    >>> import jax.numpy as jnp
    >>> vec, unflatten = flatten({"a": jnp.ones(2), "b": jnp.zeros((1, 2))})
    >>> vec.shape, unflatten(vec)["b"].shape
    ((4,), (1, 2))
  """
  leaves, treedef = jax.tree.flatten(tree)
  sizes = [math.prod(x.shape) for x in leaves]
  flat = (jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
          if leaves else jnp.zeros((0,), jnp.float32))

  def unflatten(vec):
    out, i = [], 0
    for x, s in zip(leaves, sizes):
      out.append(vec[i:i + s].reshape(x.shape).astype(x.dtype))
      i += s
    return jax.tree.unflatten(treedef, out)

  return flat, unflatten
