"""Wire formats shared by the codecs: packed bit codes, narrow indices, blocks.

Codes of `bits` bits travel packed into a uint8 stream, ceil(m * bits / 8) bytes for m codes
(1-bit signs 8 per byte, 4-bit codes 2 per byte); indices travel in the narrowest unsigned
integer that holds them. Everything here is static-shape array code.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def index_dtype(size: int) -> jnp.dtype:
  """Narrowest unsigned integer dtype holding the indices 0 .. size - 1.

  >>> index_dtype(256), index_dtype(257), index_dtype(70000)
  (dtype('uint8'), dtype('uint16'), dtype('uint32'))
  """
  for dt in (jnp.uint8, jnp.uint16, jnp.uint32):
    if size - 1 <= np.iinfo(dt).max:
      return jnp.dtype(dt)
  raise ValueError(f"size {size} needs more than 32-bit indices.")


def packed_bytes(m: int, bits: int) -> int:
  """Bytes of m codes of `bits` bits packed into a uint8 stream.

  Example:
    >>> packed_bytes(10, 3)  # 30 bits round up to 4 bytes
    4
  """
  return (m * bits + 7) // 8


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Packs unsigned codes < 2**bits into uint8[packed_bytes(m, bits)], low bits first.

  >>> pack_bits(jnp.array([1, 0, 1, 1], jnp.uint32), 1)
  Array([13], dtype=uint8)
  """
  m = codes.shape[0]
  codes = codes.astype(jnp.uint32)
  if 8 % bits == 0:  # Whole codes per byte: no bit stream needed.
    per = 8 // bits
    c = jnp.pad(codes, (0, -m % per)).reshape(-1, per)
    shifts = jnp.arange(per, dtype=jnp.uint32) * bits
    return jnp.sum(c << shifts, axis=1, dtype=jnp.uint32).astype(jnp.uint8)
  # General widths: a little-endian bit stream.
  stream = ((codes[:, None] >> jnp.arange(bits, dtype=jnp.uint32)) & 1).reshape(-1)
  stream = jnp.pad(stream, (0, -stream.shape[0] % 8)).reshape(-1, 8)
  return jnp.sum(stream << jnp.arange(8, dtype=jnp.uint32), axis=1,
                 dtype=jnp.uint32).astype(jnp.uint8)


def unpack_bits(packed: jax.Array, bits: int, m: int) -> jax.Array:
  """Inverse of `pack_bits`: uint32[m] codes.

  Example:
    >>> import jax.numpy as jnp
    >>> unpack_bits(pack_bits(jnp.array([5, 0, 7], jnp.uint32), 3), 3, 3).tolist()
    [5, 0, 7]
  """
  packed = packed.astype(jnp.uint32)
  mask = jnp.uint32((1 << bits) - 1)
  if 8 % bits == 0:
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.uint32) * bits
    return ((packed[:, None] >> shifts) & mask).reshape(-1)[:m]
  stream = ((packed[:, None] >> jnp.arange(8, dtype=jnp.uint32)) & 1).reshape(-1)
  stream = stream[:m * bits].reshape(m, bits)
  return jnp.sum(stream << jnp.arange(bits, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)


def num_blocks(n: int, block: int | None) -> int:
  """Blocks of `block` elements covering n (one block when block is None).

  >>> num_blocks(10, 4), num_blocks(10, None), num_blocks(0, 4)
  (3, 1, 1)
  """
  return 1 if block is None else max(1, math.ceil(n / block))


def blocks(x: jax.Array, block: int | None, fill: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """x as [num_blocks, block] padded with `fill`, and the mask of real elements.

  Per-block statistics (a scale per block) then need no special case for a vector whose
  length is not a multiple of the block: mask the padding, or pick a neutral `fill`.

  >>> xb, valid = blocks(jnp.arange(5.0), 2)
  >>> xb.tolist(), valid[-1].tolist()
  ([[0.0, 1.0], [2.0, 3.0], [4.0, 0.0]], [True, False])
  """
  n = x.shape[0]
  b = max(n, 1) if block is None else block
  nb = num_blocks(n, block)
  xb = jnp.pad(x, (0, nb * b - n), constant_values=fill).reshape(nb, b)
  valid = (jnp.arange(nb * b) < n).reshape(nb, b)
  return xb, valid


def unblock(xb: jax.Array, n: int) -> jax.Array:
  """Inverse of `blocks`: the first n elements, flat.

  >>> unblock(blocks(jnp.arange(5.0), 2)[0], 5).tolist()
  [0.0, 1.0, 2.0, 3.0, 4.0]
  """
  return xb.reshape(-1)[:n]


def check_bits(bits, name: str = "bits", low: int = 1, high: int = 16) -> int:
  """Validates a bit width: an int in low..high, else ValueError naming the argument."""
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not low <= bits <= high:
    raise ValueError(f"{name} must be an integer in {low}..{high}, got {bits!r}.")
  return int(bits)


def check_block(block, name: str = "block") -> int | None:
  """Validates an optional block size: None or an int >= 1."""
  if block is None:
    return None
  if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
    raise ValueError(f"{name} must be None or an integer >= 1, got {block!r}.")
  return int(block)


# Slack for float32 arithmetic in the error bounds: a few ulps of the largest magnitude
# (a bound computed in float32 adds F32_SLACK * max |x|).
F32_SLACK = 64 * float(np.finfo(np.float32).eps)
