"""DeMo's chunked DCT top-k: keep each chunk's largest orthonormal DCT-II coefficients."""

from __future__ import annotations

import math
from typing import NamedTuple

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
  1-D transform over fixed-length chunks of the concatenated gradient; `tiled_dct_top_k` is
  DeMo's per-tensor 2-D tiling.

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


def largest_divisor(n: int, limit: int) -> int:
  """The largest divisor of n that is <= limit: DeMo's chunk size for a dimension of n.

  >>> largest_divisor(100, 64), largest_divisor(64, 64), largest_divisor(97, 64)
  (50, 64, 1)
  """
  return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


class _Tiling(NamedTuple):
  """How one tensor is tiled: its matrix view rows x cols in tiles of a x b, k kept each."""
  offset: int  # first element of the tensor in the flat vector
  rows: int    # prod(shape[:-1]) (1 for a vector or a scalar)
  cols: int    # shape[-1] (1 for a scalar)
  a: int       # tile rows: largest divisor of rows <= chunk
  b: int       # tile cols: largest divisor of cols <= chunk
  k: int       # coefficients kept per tile: min(k, a * b)

  @property
  def tiles(self) -> int:
    return (self.rows // self.a) * (self.cols // self.b)


def tiled_dct_top_k(shapes, chunk: int = 64, k: int = 32) -> Codec:
  """DeMo's DCT top-k per tensor: 2-D orthonormal DCT-II over tiles, k largest per tile.

  The flat vector is the concatenation of tensors of the given `shapes` (as
  `codecs.flatten` makes it). Each tensor is viewed as a matrix, prod(shape[:-1]) x
  shape[-1] (a vector as 1 x n); each dimension is split into chunks of its largest divisor
  <= `chunk`, so a matrix is tiled into a x b tiles (vectors into 1 x b chunks, a 1-D DCT),
  and every tile's 2-D DCT-II coefficients D_a X D_b^T are computed with orthonormal
  matrices. The k largest-magnitude coefficients of each tile travel: float32 values and
  tile-local indices (the narrowest unsigned type for the largest tile). With k >= a * b
  for every tile the round trip is exact up to float32 rounding.

  This is DeMo's transform (2-D for matrices); `dct_top_k` is the 1-D variant over fixed
  chunks of any flat vector. For tensors of more than two dimensions DeMo's code assumes
  2-D weights; the matrix view above is our reading.

  Args:
    shapes: the tensors' shapes, in flat-vector order.
    chunk: the largest tile side (DeMo: 64).
    k: coefficients kept per tile, >= 1 (DeMo: 32); tiles smaller than k send them all.

  Returns:
    A deterministic, non-linear `Codec` (gather) for vectors of exactly sum(prod(shape))
    elements (its `length`: it needs the whole vector); error bound: the largest L2 norm of
    a tile's dropped coefficients. As a factory for transforms:
    `functools.partial(tiled_dct_top_k, chunk=64, k=32)` (see `for_tree`).

  References:
    Peng, Quesnelle, Kingma, DeMo: Decoupled Momentum Optimization, arXiv 2411.19870.

  >>> c = tiled_dct_top_k([(4, 6), (6,)], chunk=4, k=16)  # 4 x 3 tiles, 1 x 3 chunks
  >>> x = jnp.arange(30.0)
  >>> bool(jnp.allclose(c.roundtrip(x), x, atol=1e-4)), c.payload_bytes(30)
  (True, 150)
  """
  chunk = check_block(chunk, "chunk")
  if chunk is None:
    raise ValueError("chunk must be an integer >= 1, got None.")
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"k must be an int >= 1, got {k!r}.")
  tilings, offset = [], 0
  for shape in shapes:
    shape = tuple(shape)
    rows, cols = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    if rows * cols == 0:
      continue
    a, b = largest_divisor(rows, chunk), largest_divisor(cols, chunk)
    tilings.append(_Tiling(offset, rows, cols, a, b, min(k, a * b)))
    offset += rows * cols
  size = offset
  idx_dtype = index_dtype(max((t.a * t.b for t in tilings), default=1))
  mats = {s: jnp.asarray(dct_matrix(s)) for t in tilings for s in (t.a, t.b)}
  hi = lax.Precision.HIGHEST

  def check(n):
    if n != size:
      raise ValueError(f"tiled_dct_top_k was built for {size} elements, got {n}.")

  def coefficients(x, t):
    """f32[tiles, a * b]: each tile's 2-D DCT-II coefficients, D_a X D_b^T."""
    m = x[t.offset:t.offset + t.rows * t.cols].reshape(t.rows // t.a, t.a, t.cols // t.b, t.b)
    c = jnp.einsum("ij,rjsk,lk->rsil", mats[t.a], m, mats[t.b], precision=hi)
    return c.reshape(t.tiles, t.a * t.b)

  def encode(x, key):
    del key
    check(x.shape[0])
    vals, idxs = [], []
    for t in tilings:
      c = coefficients(x.astype(jnp.float32), t)
      _, idx = lax.top_k(jnp.abs(c), t.k)
      vals.append(jnp.take_along_axis(c, idx, axis=1).reshape(-1))
      idxs.append(idx.reshape(-1).astype(idx_dtype))
    return jnp.concatenate(vals), jnp.concatenate(idxs)

  def decode(p, n):
    check(n)
    vals, idx = p
    out, start = [], 0
    for t in tilings:
      m = t.tiles * t.k
      c = jnp.zeros((t.tiles, t.a * t.b), jnp.float32).at[
          jnp.arange(t.tiles)[:, None], idx[start:start + m].reshape(t.tiles, t.k).astype(
              jnp.int32)].set(vals[start:start + m].reshape(t.tiles, t.k))
      start += m
      c = c.reshape(t.rows // t.a, t.cols // t.b, t.a, t.b)
      out.append(jnp.einsum("ij,rsil,lk->rjsk", mats[t.a], c, mats[t.b],
                            precision=hi).reshape(-1))
    return jnp.concatenate(out) if out else jnp.zeros((0,), jnp.float32)

  def error_bound(x):
    dropped = [jnp.sqrt(jnp.sum(jnp.sort(coefficients(x, t) ** 2, axis=1)[:, :t.a * t.b - t.k],
                                axis=1)).max() for t in tilings]
    tile = max((t.a * t.b for t in tilings), default=1)
    return jnp.max(jnp.stack(dropped)) + F32_SLACK * math.sqrt(tile) * jnp.max(jnp.abs(x))

  def payload_bytes(n):
    check(n)
    return sum(t.tiles * t.k for t in tilings) * (4 + idx_dtype.itemsize)

  return Codec(f"tiled_dct_top_k(chunk={chunk}, k={k})", encode, decode,
               payload_bytes=payload_bytes, error_bound=error_bound, collective="gather",
               length=size)
