"""Counter-based uniform numbers for stochastic rounding: one fused pass over the codes.

`jax.random.uniform` runs threefry-2x32 (20 rounds) per pair of elements; on a CPU that costs
an order of magnitude more than the quantiser's own pass over the vector. Stochastic
rounding needs numbers that are uniform on [0, 1) and independent between elements and
between draws, not a cryptographic stream, so the codecs draw ONE 64-bit seed (s0, s1) from
the key per call (a single threefry evaluation) and hash each element's index with it:

  word(i) = h(h(i ^ s0) ^ s1),   h = lowbias32 (C. Wellons' hash-prospector: xorshift-multiply
                                  rounds with measured avalanche bias ~0.17%)

h is a bijection of uint32, so the words of one draw are distinct for distinct indices;
the seed enters twice, so two draws share no structure unless both seed words collide.
The float is the top 23 bits as a mantissa in [1, 2), minus 1 (as `jax.random.uniform`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_U32 = jnp.uint32


def _lowbias32(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * _U32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * _U32(0x846CA68B)
  return x ^ (x >> 16)


def random_bits(key: Any, shape: tuple) -> jax.Array:
  """uint32 words of `shape`, a pure function of (key, element index in row-major order).

  >>> w = random_bits(jax.random.key(0), (3,))
  >>> w.dtype, bool(jnp.all(w == random_bits(jax.random.key(0), (3,))))
  (dtype('uint32'), True)
  """
  seed = jax.random.bits(key, (2,), _U32)
  size = 1
  for d in shape:
    size *= d
  index = lax.iota(_U32, size).reshape(shape)
  return _lowbias32(_lowbias32(index ^ seed[0]) ^ seed[1])


def uniform(key: Any, shape: tuple) -> jax.Array:
  """float32 uniform on [0, 1) in steps of 2**-23, from `random_bits`.

  >>> u = uniform(jax.random.key(0), (1000,))
  >>> bool(u.min() >= 0.0), bool(u.max() < 1.0), round(float(u.mean()), 1)
  (True, True, 0.5)
  """
  mantissa = (random_bits(key, shape) >> 9) | _U32(0x3F800000)
  return lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0
