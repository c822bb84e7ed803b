"""DeMo's chunked DCT top-k: keep each chunk's largest orthonormal DCT-II coefficients."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm.codecs._base import Codec
from jaxcomm.codecs._bits import F32_SLACK, blocks, check_block, index_dtype, num_blocks, unblock


def dct_matrix(size: int) -> np.ndarray:
  """The orthonormal DCT-II matrix D (size x size): coefficients c = D x, inverse x = D^T c.

  >>> d = dct_matrix(4)
  >>> bool(np.allclose(d @ d.T, np.eye(4), atol=1e-6))
  True
  """
  i = np.arange(size)
  d = np.sqrt(2.0 / size) * np.cos(np.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * size))
  d[0] /= np.sqrt(2.0)
  return d.astype(np.float32)


def dct_top_k(chunk: int = 64, k: int = 32) -> Codec:
  """Chunked orthonormal DCT-II, then the k largest-magnitude coefficients of every chunk.

  The flat vector is split into chunks of `chunk` elements (zero-padded at the end); each
  chunk's DCT-II coefficients are computed with an orthonormal matrix, so dropping
  coefficients loses exactly their L2 norm. Payload: float32 coefficient values and
  chunk-local indices (uint8 for chunks up to 256). With k = chunk the round trip is exact
  up to float32 rounding.

  DeMo splits each dimension of a parameter into chunks (the largest divisor <= 64) and uses
  a 2-D DCT per tile of a matrix; the codec contract works on flat vectors, so this is the
  1-D transform over fixed-length chunks of the concatenated gradient. A 2-D tiling is not
  implemented here.

  Args:
    chunk: DCT length (DeMo: 64).
    k: coefficients kept per chunk, 1..chunk (DeMo: 32).

  Returns:
    A deterministic, non-linear `Codec` (gather); error bound: the L2 norm of a chunk's
    dropped coefficients.

  References:
    Peng, Quesnelle, Kingma, DeMo: Decoupled Momentum Optimization, arXiv 2411.19870.

  >>> c = dct_top_k(chunk=4, k=4)
  >>> x = jnp.array([1., 2., 3., 4., 5.])
  >>> bool(jnp.allclose(c.roundtrip(x), x, atol=1e-5)), c.payload_bytes(5)
  (True, 40)
  """
  chunk = check_block(chunk, "chunk")
  if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk:
    raise ValueError(f"k must be an int in 1..chunk ({chunk}), got {k!r}.")
  d = jnp.asarray(dct_matrix(chunk))
  hi = lax.Precision.HIGHEST

  def coefficients(x):
    xb, _ = blocks(x, chunk)
    return jnp.matmul(xb, d.T, precision=hi)

  def encode(x, key):
    del key
    c = coefficients(x)
    _, idx = lax.top_k(jnp.abs(c), k)
    return (jnp.take_along_axis(c, idx, axis=1).reshape(-1),
            idx.reshape(-1).astype(index_dtype(chunk)))

  def decode(p, n):
    vals, idx = p
    nc = num_blocks(n, chunk)
    c = jnp.zeros((nc, chunk), jnp.float32).at[
        jnp.arange(nc)[:, None], idx.reshape(nc, k).astype(jnp.int32)].set(vals.reshape(nc, k))
    return unblock(jnp.matmul(c, d, precision=hi), n)

  def error_bound(x):
    c2 = jnp.sort(coefficients(x) ** 2, axis=1)  # ascending: the dropped ones come first
    dropped = jnp.sqrt(jnp.sum(c2[:, :chunk - k], axis=1))
    return jnp.max(dropped) + F32_SLACK * math.sqrt(chunk) * jnp.max(jnp.abs(x))

  return Codec(f"dct_top_k(chunk={chunk}, k={k})", encode, decode,
               payload_bytes=lambda n: num_blocks(n, chunk) * k * (4 + index_dtype(chunk).itemsize),
               error_bound=error_bound, collective="gather")
