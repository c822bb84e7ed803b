"""DeMo's chunked DCT top-k: keep each chunk's largest orthonormal DCT-II coefficients."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import _validate as v
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
  k = v.integer("k", k, low=1, high=chunk)  # at most the chunk's coefficients
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

  def decode_sum(p, n):  # W payloads: scatter-add every coefficient, invert once
    vals, idx = p
    nc = num_blocks(n, chunk)
    vals, idx = vals.reshape(-1, nc, k), idx.reshape(-1, nc, k).astype(jnp.int32)
    c = jnp.zeros((nc, chunk), jnp.float32).at[jnp.arange(nc)[None, :, None], idx].add(vals)
    return unblock(jnp.matmul(c, d, precision=hi), n)

  def decode(p, n):
    return decode_sum(jax.tree.map(lambda v: v[None], p), n)

  def error_bound(x):
    c2 = jnp.sort(coefficients(x) ** 2, axis=1)  # ascending: the dropped ones come first
    dropped = jnp.sqrt(jnp.sum(c2[:, :chunk - k], axis=1))
    return jnp.max(dropped) + F32_SLACK * math.sqrt(chunk) * jnp.max(jnp.abs(x))

  return Codec(f"dct_top_k(chunk={chunk}, k={k})", encode, decode,
               payload_bytes=lambda n: num_blocks(n, chunk) * k * (4 + index_dtype(chunk).itemsize),
               error_bound=error_bound, collective="gather", decode_sum=decode_sum)


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

  def to_tiles(self, x: jax.Array) -> jax.Array:
    """f32[tiles, a, b]: the tensor's tiles, row-major over the tile grid."""
    m = x[self.offset:self.offset + self.rows * self.cols]
    m = m.reshape(self.rows // self.a, self.a, self.cols // self.b, self.b)
    return m.transpose(0, 2, 1, 3).reshape(self.tiles, self.a, self.b)

  def from_tiles(self, t: jax.Array) -> jax.Array:
    """Inverse of `to_tiles`: the tensor's elements, flat."""
    m = t.reshape(self.rows // self.a, self.cols // self.b, self.a, self.b)
    return m.transpose(0, 2, 1, 3).reshape(-1)


class _Group(NamedTuple):
  """The tensors whose tiles share (a, b, k): one batched transform and selection."""
  members: tuple   # _Tiling, in flat-vector order
  start: int       # first coefficient slot of the group in the payload

  @property
  def a(self) -> int:
    return self.members[0].a

  @property
  def b(self) -> int:
    return self.members[0].b

  @property
  def k(self) -> int:
    return self.members[0].k

  @property
  def tiles(self) -> int:
    return sum(t.tiles for t in self.members)


def _groups(tilings) -> list:
  """Tilings grouped by (a, b, k), groups in order of first appearance; payload slots."""
  by_shape = {}
  for t in tilings:
    by_shape.setdefault((t.a, t.b, t.k), []).append(t)
  groups, start = [], 0
  for members in by_shape.values():
    groups.append(_Group(tuple(members), start))
    start += groups[-1].tiles * members[0].k
  return groups


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

  All tiles of one shape (a, b) are transformed by one batched matmul and selected by one
  top-k, whatever tensors they come from: the payload lists tile shapes in order of first
  appearance, and within a shape the tensors in order, their tiles row-major, k (value,
  index) pairs per tile (by decreasing magnitude).

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
  chunk = v.integer("chunk", chunk, low=1)
  k = v.integer("k", k, low=1)
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
  groups = _groups(tilings)
  idx_dtype = index_dtype(max((t.a * t.b for t in tilings), default=1))
  mats = {s: jnp.asarray(dct_matrix(s)) for t in tilings for s in (t.a, t.b)}
  hi = lax.Precision.HIGHEST

  def check(n):
    if n != size:
      raise ValueError(f"tiled_dct_top_k was built for {size} elements, got {n}.")

  def coefficients(x, g):
    """f32[tiles, a * b]: the group's tiles' 2-D DCT-II coefficients, D_a X D_b^T."""
    tiles = jnp.concatenate([t.to_tiles(x) for t in g.members])
    c = jnp.einsum("ij,tjk,lk->til", mats[g.a], tiles, mats[g.b], precision=hi)
    return c.reshape(g.tiles, g.a * g.b)

  def encode(x, key):
    del key
    check(x.shape[0])
    vals, idxs = [], []
    for g in groups:
      c = coefficients(x.astype(jnp.float32), g)
      _, idx = lax.top_k(jnp.abs(c), g.k)
      vals.append(jnp.take_along_axis(c, idx, axis=1).reshape(-1))
      idxs.append(idx.reshape(-1).astype(idx_dtype))
    return jnp.concatenate(vals), jnp.concatenate(idxs)

  def inverse(g, v, i):
    """f32[tiles, a, b] from each tile's coefficient terms (values v, indices i: [tiles, s]).

    s rank-one terms cost 2 a b s FLOPs per tile, the dense inverse D_a^T C D_b 2 a b (a + b)
    after a scatter-add: the cheaper one runs (one payload's k = 32 of a 64 x 64 tile: 4x).
    """
    if v.shape[1] < g.a + g.b:
      rows = mats[g.a][i // g.b] * v[..., None]  # [tiles, s, a]: c_s D_a[i_s, :]
      return jnp.einsum("tsp,tsq->tpq", rows, mats[g.b][i % g.b], precision=hi)
    c = jnp.zeros((g.tiles, g.a * g.b), jnp.float32).at[jnp.arange(g.tiles)[:, None], i].add(v)
    return jnp.einsum("ij,til,lk->tjk", mats[g.a], c.reshape(g.tiles, g.a, g.b), mats[g.b],
                      precision=hi)

  def decode_sum(p, n):  # W payloads: every tile's W k terms inverted together
    check(n)
    vals, idx = (v.reshape(v.shape[0], -1) for v in p)
    parts = []
    for g in groups:
      m, w = g.tiles * g.k, vals.shape[0]
      terms = lambda a: a[:, g.start:g.start + m].reshape(w, g.tiles, g.k).transpose(
          1, 0, 2).reshape(g.tiles, w * g.k)
      tiles = inverse(g, terms(vals), terms(idx).astype(jnp.int32))
      start = 0
      for t in g.members:
        parts.append((t.offset, t.from_tiles(tiles[start:start + t.tiles])))
        start += t.tiles
    parts.sort(key=lambda part: part[0])
    return (jnp.concatenate([part for _, part in parts]) if parts
            else jnp.zeros((0,), jnp.float32))

  def decode(p, n):
    return decode_sum(jax.tree.map(lambda v: v[None], p), n)

  def error_bound(x):
    dropped = [jnp.sqrt(jnp.sum(jnp.sort(coefficients(x, g) ** 2, axis=1)[:, :g.a * g.b - g.k],
                                axis=1)).max() for g in groups]
    tile = max((t.a * t.b for t in tilings), default=1)
    return jnp.max(jnp.stack(dropped)) + F32_SLACK * math.sqrt(tile) * jnp.max(jnp.abs(x))

  def payload_bytes(n):
    check(n)
    return sum(t.tiles * t.k for t in tilings) * (4 + idx_dtype.itemsize)

  return Codec(f"tiled_dct_top_k(chunk={chunk}, k={k})", encode, decode,
               payload_bytes=payload_bytes, error_bound=error_bound, collective="gather",
               length=size, decode_sum=decode_sum)
