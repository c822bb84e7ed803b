"""Sparsifiers: a few (value, index) pairs per vector or per chunk.

Values travel as float32, indices in the narrowest unsigned integer that holds them
(chunk-local indices with `chunk`, which is why chunking pays: a 64-element chunk needs
uint8). Supports differ between workers, so these codecs are non-linear and prefer the
all-gather of pairs, except random-k with a key shared by all workers: every worker picks
the same coordinates, only the values travel, and the receiver regenerates the indices.
"""

from __future__ import annotations

import numbers

import jax  # noqa: F401 (the docstring examples use it)
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import _validate as v
from jaxcomm.codecs import _random
from jaxcomm.codecs import _select
from jaxcomm.codecs._base import Codec
from jaxcomm.codecs._bits import F32_SLACK, blocks, check_block, index_dtype, num_blocks, unblock


def _check_count(value, name: str):
  """A count (int >= 1) or a fraction (float in (0, 1]); returns it unchanged."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name} must be an int >= 1 (a count) or a float in (0, 1] (a fraction), "
                     f"got {value!r}.")
  if isinstance(value, numbers.Integral):
    if value < 1:
      raise ValueError(f"{name} must be an int >= 1 (a count), got {value!r}.")
  elif not 0.0 < value <= 1.0:
    raise ValueError(f"{name} as a fraction must be in (0, 1], got {value!r}.")
  return value


def _fraction_or_k(fraction, k):
  if (fraction is None) == (k is None):
    raise ValueError(f"give exactly one of fraction (in (0, 1]) or k (an int >= 1), got "
                     f"fraction={fraction!r}, k={k!r}.")
  if fraction is not None:
    return v.number("fraction", fraction, low=0.0, high=1.0, low_open=True)
  return v.integer("k", k, low=1)


def _resolve(count, size: int, name: str) -> int:
  """Elements kept out of `size`: a count as is, a fraction as max(1, round(f * size))."""
  out = int(count) if isinstance(count, numbers.Integral) else max(1, round(count * size))
  if out > size:
    raise ValueError(f"{name}={count} keeps {out} elements but the vector (or chunk) has only "
                     f"{size}.")
  return out


def _scatter(vals, idx, n):
  return jnp.zeros((n,), jnp.float32).at[idx.astype(jnp.int32)].set(vals)


def _scatter_sum(p, n):
  """decode_sum of (values, indices) payloads stacked on a leading axis: one scatter-add."""
  vals, idx = p
  return jnp.zeros((n,), jnp.float32).at[idx.reshape(-1).astype(jnp.int32)].add(vals.reshape(-1))


def _describe(count):
  return f"k={count}" if isinstance(count, int) else f"{count:g}"


def top_k(fraction: float | None = None, *, k: int | None = None,
          chunk: int | None = None) -> Codec:
  """The k largest-magnitude elements of the vector, or of every chunk of `chunk` elements.

  Payload: float32 values and indices (uint8 for chunks of at most 256 elements; otherwise
  the narrowest type for the vector length). k = max(1, round(fraction * size)) where size
  is the chunk (or vector) length. Ties at the k-th magnitude keep the lowest indices (as
  `lax.top_k`). The order of the pairs carries no meaning: over the whole vector they
  travel in index order (a sort-free selection, `_select.top_k_indices`), per chunk by
  decreasing magnitude. Inputs must be NaN-free.

  Args:
    fraction: fraction of each chunk (or of the vector) kept, in (0, 1].
    k: or the count kept per chunk (or per vector).
    chunk: chunk length; None selects over the whole vector.

  Returns:
    A deterministic, non-linear `Codec`; error bound: the k-th largest magnitude of a chunk.

  References:
    Stich, Cordonnier, Jaggi, Sparsified SGD with Memory, NeurIPS 2018 (arXiv 1809.07599).

  >>> c = top_k(k=1, chunk=2)
  >>> c.roundtrip(jnp.array([1., -3., 2., 0.5])), c.payload_bytes(4)
  (Array([ 0., -3.,  2.,  0.], dtype=float32), 10)
  """
  count = _fraction_or_k(fraction, k)
  chunk = check_block(chunk, "chunk")
  if chunk is not None and k is not None and k > chunk:
    raise ValueError(f"k ({k}) is larger than chunk ({chunk}); k counts elements per chunk.")

  def layout(n):
    size = max(n, 1) if chunk is None else chunk
    return size, num_blocks(n, chunk), _resolve(count, size, "k" if k else "fraction")

  def encode(x, key):
    del key
    size, _, kk = layout(x.shape[0])
    xb, _ = blocks(x, chunk)
    if chunk is None:  # the whole vector: sort-free selection, pairs in index order
      idx = _select.top_k_indices(jnp.abs(xb[0]), kk)
      return (xb[0][idx], idx.astype(index_dtype(size)))
    _, idx = lax.top_k(jnp.abs(xb), kk)  # per chunk: pairs by decreasing magnitude
    vals = jnp.take_along_axis(xb, idx, axis=1)
    return (vals.reshape(-1), idx.reshape(-1).astype(index_dtype(size)))

  def decode(p, n):
    size, nc, kk = layout(n)
    vals, idx = p
    rows = jnp.arange(nc)[:, None]
    out = jnp.zeros((nc, size), jnp.float32).at[rows, idx.reshape(nc, kk).astype(jnp.int32)].set(
        vals.reshape(nc, kk))
    return unblock(out, n)

  def decode_sum(p, n):  # W payloads: one scatter-add of all pairs (chunk-local indices)
    size, nc, kk = layout(n)
    vals, idx = (v.reshape(-1, nc, kk) for v in p)
    rows = jnp.arange(nc)[None, :, None]
    out = jnp.zeros((nc, size), jnp.float32).at[rows, idx.astype(jnp.int32)].add(vals)
    return unblock(out, n)

  def payload_bytes(n):
    size, nc, kk = layout(n)
    return nc * kk * (4 + index_dtype(size).itemsize)

  def error_bound(x):
    _, _, kk = layout(x.shape[0])
    xb, _ = blocks(jnp.abs(x), chunk)
    kth = -jnp.sort(-xb, axis=1)[:, kk - 1]
    return jnp.max(kth) * (1 + F32_SLACK)

  return Codec(f"top_k({_describe(count)}, chunk={chunk})", encode, decode, payload_bytes,
               error_bound=error_bound, collective="gather", decode_sum=decode_sum)


class _Strata:
  """k near-equal consecutive blocks of range(n) (sizes floor or ceil of n/k), one pick each.

  Every index of a block of size s is picked with probability 1/s, within 1/ceil(n/k) of the
  k/n of a uniformly random k-subset, at O(k) cost (a permutation of n costs a sort of n).
  The receiver knows each pick's block from its position, so only the offset inside the
  block travels: index_dtype(ceil(n/k)), uint8 for n/k <= 256.
  """

  def __init__(self, n: int, k: int):
    bounds = (np.arange(k + 1, dtype=np.int64) * n) // k
    self.start = bounds[:-1].astype(np.int32)
    self.size = np.diff(bounds).astype(np.int32)
    self.offset_dtype = index_dtype(int(self.size.max()))

  def offsets(self, key):
    """A uniform offset in every block: counter-based 32-bit words (`_random`) modulo the
    block size (bias below size / 2**32; threefry's randint cost ~70 ns per pick on CPU)."""
    words = _random.random_bits(key, self.start.shape)
    return (words % jnp.asarray(self.size, jnp.uint32)).astype(jnp.int32)

  def indices(self, offsets):
    return jnp.asarray(self.start) + offsets.astype(jnp.int32)


def random_k(fraction: float | None = None, *, k: int | None = None,
             shared_key: bool = True) -> Codec:
  """k random coordinates, one in each of k near-equal consecutive blocks; unscaled.

  Stratified sampling: every coordinate is kept with (almost exactly) probability k/n as with
  a uniformly random k-subset, the k picks are distinct, and only the offset inside each block
  needs to travel. With `shared_key=True` every worker must encode with the same key: all pick
  the same coordinates, only the float32 values travel, decode regenerates the indices from
  the key (`decode(payload, n, key)`), and the codec is linear (payloads may be summed with
  psum). With `shared_key=False` each worker draws its own coordinates and the offsets
  travel. Values are not rescaled by n/k: use it with error feedback.

  Args:
    fraction: fraction of the vector kept, in (0, 1].
    k: or the count kept.
    shared_key: whether all workers share the key (linear, values only).

  >>> c = random_k(k=2)
  >>> key = jax.random.key(0)
  >>> int(jnp.sum(c.roundtrip(jnp.ones(5), key) != 0)), c.payload_bytes(5), c.linear
  (2, 8, True)
  """
  count = _fraction_or_k(fraction, k)
  name = "k" if k else "fraction"

  def strata(n):
    return _Strata(n, _resolve(count, n, name))

  def check(key):
    if key is None:
      raise ValueError("random_k is stochastic: encode and decode need a PRNG key, got None.")

  def encode(x, key):
    check(key)
    st = strata(x.shape[0])
    off = st.offsets(key)
    vals = x[st.indices(off)]
    return (vals,) if shared_key else (vals, off.astype(st.offset_dtype))

  def decode_shared(p, n, key):
    check(key)
    st = strata(n)
    return _scatter(p[0], st.indices(st.offsets(key)), n)

  def decode_own(p, n):
    return _scatter(p[0], strata(n).indices(p[1]), n)

  def payload_bytes(n):
    st = strata(n)
    return st.start.size * (4 if shared_key else 4 + st.offset_dtype.itemsize)

  return Codec(f"random_k({_describe(count)}{', shared' if shared_key else ''})", encode,
               decode_shared if shared_key else decode_own, payload_bytes, linear=shared_key,
               stochastic=True, shared_key=shared_key,
               error_bound=lambda x: jnp.max(jnp.abs(x)), collective="gather",
               decode_sum=None if shared_key else (lambda p, n: _scatter_sum(
                   (p[0], jnp.asarray(strata(n).start) + p[1].astype(jnp.int32)), n)))


def rtop_k(r: int | float, k: int | float, *, order: str = "rank") -> Codec:
  """rTop-k: the r largest-magnitude elements, of which a uniformly random k are sent.

  r and k are counts (int) or fractions of the vector length (float in (0, 1]); k <= r.
  The k are drawn stratified (see `random_k`) over the top r listed by `order`: "rank" (by
  decreasing magnitude, as `lax.top_k` lists them: this needs a sort of the r) or "index"
  (in index order: no sort, several times faster for large r). Either way each of the top r
  is sent with probability about k/r and the k are distinct; "rank" also spreads them over
  the magnitudes. Payload: float32 values and indices. Each worker draws its own subset
  (non-linear).

  References:
    Barnes, Inan, Isik, Ozgur, rTop-k: A Statistical Estimation Approach to Distributed SGD,
    arXiv 2005.10761.

  >>> c = rtop_k(2, 1)
  >>> out = c.roundtrip(jnp.array([5., -4., 0.1, 0.2]), jax.random.key(0))
  >>> int(jnp.sum(out != 0)), bool(jnp.abs(out).max() >= 4), c.payload_bytes(4)
  (1, True, 5)
  """
  r, k = _check_count(r, "r"), _check_count(k, "k")
  order = v.one_of("order", order, ("rank", "index"))
  if isinstance(r, numbers.Integral) == isinstance(k, numbers.Integral) and k > r:
    raise ValueError(f"k ({k}) must not exceed r ({r}): k of the top r are sent.")

  def sizes(n):
    rr, kk = _resolve(r, n, "r"), _resolve(k, n, "k")
    if kk > rr:
      raise ValueError(f"k={k} keeps {kk} elements, more than r={r} ({rr}) for n={n}.")
    return rr, kk

  def encode(x, key):
    if key is None:
      raise ValueError("rtop_k is stochastic: encode needs a PRNG key, got None.")
    rr, kk = sizes(x.shape[0])
    top = _select.top_k_indices(jnp.abs(x), rr)  # the top r in index order
    if order == "rank":  # a sort of r: lax.top_k(|x|, r)'s order
      top = top[lax.top_k(jnp.abs(x[top]), rr)[1]]
    st = _Strata(rr, kk)  # k of the top r (in `order`), each with probability k/r
    idx = top[st.indices(st.offsets(key))]
    return (x[idx], idx.astype(index_dtype(x.shape[0])))

  def payload_bytes(n):
    return sizes(n)[1] * (4 + index_dtype(n).itemsize)

  suffix = "" if order == "rank" else ", order=index"
  return Codec(f"rtop_k(r={_describe(r)}, k={_describe(k)}{suffix})", encode,
               lambda p, n: _scatter(p[0], p[1], n), payload_bytes, stochastic=True,
               error_bound=lambda x: jnp.max(jnp.abs(x)), collective="gather",
               decode_sum=_scatter_sum)
