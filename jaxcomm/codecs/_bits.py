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
from jax import lax

from jaxcomm import _validate as v


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


def _groups(bits: int) -> tuple[int, int, int]:
  """(codes, bytes, 32-bit lanes) of the smallest whole group, lcm(bits, 8) bits: 3-bit codes
  come 8 to a group of 3 bytes in one lane, 5-bit codes 8 to 5 bytes in two lanes."""
  span = math.lcm(bits, 8)
  return span // bits, span // 8, -(-span // 32)


def _shifts(bits: int) -> np.ndarray:
  """int32[lanes, codes]: how far code i of a group moves right to land in lane l (32 l - i
  bits; negative: left), and 32 (shifts it out) where the code misses the lane."""
  per, _, lanes = _groups(bits)
  lane, i = np.arange(lanes)[:, None], np.arange(per)[None, :]
  meets = (i * bits < 32 * lane + 32) & (32 * lane < (i + 1) * bits)
  return np.where(meets, 32 * lane - i * bits, 32).astype(np.int32)


def _shift(v: jax.Array, right: jax.Array) -> jax.Array:
  """v >> right where right >= 0, v << -right elsewhere (0 for amounts of 32 or more)."""
  return jnp.where(right >= 0, v >> jnp.abs(right).astype(v.dtype),
                   v << jnp.abs(right).astype(v.dtype))


_BYTE_SHIFTS = np.array([0, 8, 16, 24], np.uint32)  # a lane's bytes, little-endian


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Packs unsigned codes < 2**bits into uint8[packed_bytes(m, bits)], low bits first.

  The stream is little-endian: code i occupies bits [i bits, (i + 1) bits), byte j holds
  bits [8j, 8j + 8). It is built a group of lcm(bits, 8) bits at a time (4-bit codes: 2 per
  byte; 3-bit codes: 8 per 3 bytes): the group's 32-bit lanes are ORs of its codes shifted
  into place, a reduction over the group that XLA runs as its own vectorised pass after the
  codes (fusing the codes' arithmetic into a strided packing loop would un-vectorise it),
  and the bytes are the lanes' bytes.

  >>> pack_bits(jnp.array([1, 0, 1, 1], jnp.uint32), 1)
  Array([13], dtype=uint8)
  """
  m = codes.shape[0]
  per, nbytes, _ = _groups(bits)
  c = jnp.pad(codes.astype(jnp.uint32), (0, -m % per)).reshape(-1, 1, per)
  moved = _shift(c, jnp.asarray(_shifts(bits)))  # [groups, lanes, per]
  lanes = lax.reduce(moved, jnp.uint32(0), lax.bitwise_or, (2,))
  if nbytes > 1:  # a group of several bytes: every lane's bytes, the group's first nbytes
    lanes = (lanes[:, :, None] >> _BYTE_SHIFTS).reshape(lanes.shape[0], -1)[:, :nbytes]
  return lanes.astype(jnp.uint8).reshape(-1)[:packed_bytes(m, bits)]  # astype: the low byte


def unpack_bits(packed: jax.Array, bits: int, m: int) -> jax.Array:
  """Inverse of `pack_bits`: uint32[m] codes.

  Example:
    >>> import jax.numpy as jnp
    >>> unpack_bits(pack_bits(jnp.array([5, 0, 7], jnp.uint32), 3), 3, 3).tolist()
    [5, 0, 7]
  """
  per, nbytes, lanes = _groups(bits)
  groups = -(-m // per)
  b = jnp.pad(packed.astype(jnp.uint32), (0, groups * nbytes - packed.shape[0]))
  if nbytes == 1:  # one byte per group: it is the lane
    words = b.reshape(groups, 1)
  else:
    b = jnp.pad(b.reshape(groups, nbytes), ((0, 0), (0, 4 * lanes - nbytes)))
    words = b.reshape(groups, lanes, 4) << _BYTE_SHIFTS
    words = words[..., 0] | words[..., 1] | words[..., 2] | words[..., 3]  # [groups, lanes]
  parts = _shift(words[:, :, None], -jnp.asarray(_shifts(bits)))  # lane l's part of code i
  codes = parts[:, 0, :]
  for lane in range(1, lanes):
    codes = codes | parts[:, lane, :]
  return (codes & jnp.uint32((1 << bits) - 1)).reshape(-1)[:m]


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


def block_sizes(n: int, block: int | None) -> np.ndarray:
  """float32[num_blocks]: the real elements of every block (all `block` but the last), static."""
  nb = num_blocks(n, block)
  b = max(n, 1) if block is None else block
  return np.minimum(b, n - b * np.arange(nb)).clip(0).astype(np.float32)


def unblock(xb: jax.Array, n: int) -> jax.Array:
  """Inverse of `blocks`: the first n elements, flat.

  >>> unblock(blocks(jnp.arange(5.0), 2)[0], 5).tolist()
  [0.0, 1.0, 2.0, 3.0, 4.0]
  """
  return xb.reshape(-1)[:n]


def check_bits(bits, name: str = "bits", low: int = 1, high: int = 16) -> int:
  """Validates a bit width: an int in low..high, else ValueError naming the argument."""
  return v.integer(name, bits, low=low, high=high)


def check_block(block, name: str = "block") -> int | None:
  """Validates an optional block size: None or an int >= 1."""
  return v.integer(name, block, low=1, allow_none=True)


#: Slack for float32 arithmetic in the error bounds: a few ulps of the largest magnitude
#: (a bound computed in float32 adds F32_SLACK * max |x|).
F32_SLACK = 64 * float(np.finfo(np.float32).eps)
