"""Exact top-k selection without a sort of the vector: what the sparsifiers run on large inputs.

`lax.top_k` on XLA:CPU is a partial sort through a comparator callback (tens of ns per
element); a sort-free selection reads the vector once and then works on ~k elements:

1. A threshold t from a fixed random sample: the sample's r-th largest value, r chosen so
   that t lies below the k-th largest value of the vector with overwhelming probability
   and ~1.3 k entries of the vector are >= t.
2. One pass over the vector: for every row of 32 entries a 32-bit mask of the entries >= t
   (the candidates), its popcount, and the rows' running totals (a cumulative sum by
   blocked matmul with a triangular matrix: exact for integer counts, vectorised).
3. The candidates in index order, without a scatter: slot j finds its row by binary search
   in the running totals and its entry as the right set bit of the row's mask.
4. The k-th largest candidate exactly, by bisection on the float bit patterns (non-negative
   floats order like their bits), then the k survivors in index order the same way as 3.

If the sample misjudged (fewer than k candidates, or more than the buffer holds) the result
comes from `lax.top_k` instead (`lax.cond`; under `vmap` each vector decides for itself), so
the output never depends on luck, only the time does. Ties at the k-th value keep the
lowest indices, as `lax.top_k` does. Inputs must be NaN-free.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ROW = 32           # entries per candidate mask word
_SAMPLE_HITS = 512  # expected sample entries above the k-th largest value
_MIN_N = 1 << 15    # below this, lax.top_k is cheap enough
_HI = lax.Precision.HIGHEST


def _plan(n: int, k: int):
  """(sample positions, sample rank r, candidate buffer size), or None for `lax.top_k`."""
  if n < _MIN_N or k < 1:
    return None
  size = min(n // 8, math.ceil(_SAMPLE_HITS * n / k))
  hits = size * k / n  # expected sample entries among the top k
  if hits < 16:
    return None
  r = math.ceil(hits + 5 * math.sqrt(hits))  # P(r sample hits above the k-th value) < 1e-6
  cap = math.ceil(k * (1 + 11 / math.sqrt(hits))) + _ROW  # ~+6 sigma of the candidate count
  if cap > n // 4:
    return None
  pos = np.sort(np.random.default_rng(0).choice(n, size, replace=False)).astype(np.int32)
  return pos, r, cap


def cumsum(counts: jax.Array, block: int = 128) -> jax.Array:
  """Inclusive cumulative sum of non-negative int32 counts (block * max count < 2**24).

  Within blocks of `block` a float32 matmul with a triangular matrix (exact for these
  integers, vectorised); across blocks an int32 cumsum of the block totals.

  >>> cumsum(jnp.array([1, 0, 2, 5], jnp.int32)).tolist()
  [1, 1, 3, 8]
  """
  m = counts.shape[0]
  c = jnp.pad(counts, (0, -m % block)).reshape(-1, block)
  tri = jnp.asarray(np.triu(np.ones((block, block), np.float32)))
  within = jnp.matmul(c.astype(jnp.float32), tri, precision=_HI).astype(jnp.int32)
  before = jnp.cumsum(within[:, -1]) - within[:, -1]
  return (within + before[:, None]).reshape(-1)[:m]


def _nth_set_bit(words: jax.Array, rank: jax.Array) -> jax.Array:
  """Position of the rank-th (0-based) set bit of each uint32 word (rank < popcount)."""
  pos = jnp.zeros(words.shape, jnp.uint32)
  for step in (16, 8, 4, 2, 1):
    low = words & ((jnp.uint32(1) << (pos + step)) - 1)
    pos = jnp.where(lax.population_count(low).astype(jnp.int32) <= rank, pos + step, pos)
  return pos.astype(jnp.int32)


def _compact(words: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """Positions (ascending) of the set bits of `words` (bit i of word r: 32 r + i), in a
  buffer of `size` slots, and their count; slots past the count hold garbage."""
  counts = lax.population_count(words).astype(jnp.int32)
  ends = cumsum(counts)
  slot = jnp.arange(size, dtype=jnp.int32)
  row = jnp.minimum(jnp.searchsorted(ends, slot, side="right"), words.shape[0] - 1)
  rank = slot - (ends[row] - counts[row])
  return row * _ROW + _nth_set_bit(words[row], rank), ends[-1]


def _pack_words(mask: jax.Array) -> jax.Array:
  """uint32 words of 32 mask bits each (mask length a multiple of 32)."""
  bits = mask.reshape(-1, _ROW).astype(jnp.uint32) << lax.iota(jnp.uint32, _ROW)
  return jnp.sum(bits, axis=1, dtype=jnp.uint32)  # distinct bits: the sum is the OR


def _kth_largest_bits(bits: jax.Array, k: int) -> jax.Array:
  """The k-th largest of int32 values >= 0 (entries < 0 are ignored), by bisection.

  Invariant: at least k values >= lo, fewer than k values > hi; 31 halvings of [0, 2**31).
  Unrolled (a loop carry would have to match the varying axes of a shard_map).
  """
  lo, hi = jnp.int32(0), jnp.int32(2 ** 31 - 1)
  for _ in range(31):
    mid = lo + (hi - lo) // 2 + (hi > lo)  # upper middle, no int32 overflow
    enough = jnp.sum(bits >= mid) >= k
    lo, hi = jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)
  return lo


def _reference(a: jax.Array, k: int) -> jax.Array:
  return jnp.sort(lax.top_k(a, k)[1])


def top_k_indices(a: jax.Array, k: int) -> jax.Array:
  """int32[k]: indices of the k largest entries of `a` (>= 0, NaN-free), ascending.

  The set is `lax.top_k(a, k)`'s (ties at the k-th value keep the lowest indices); the
  order is the index order, not the value order.

  >>> top_k_indices(jnp.array([0.5, 3.0, 1.0, 3.0]), 2).tolist()
  [1, 3]
  """
  n = a.shape[0]
  plan = _plan(n, k)
  if plan is None:
    return _reference(a, k)
  pos, r, cap = plan

  @jax.custom_batching.sequential_vmap  # keep lax.cond a branch under vmap
  def select(a):
    t = jnp.min(lax.top_k(a[pos], r)[0])  # (not [r - 1]: XLA would turn that into a full sort)
    padded = jnp.pad(a, (0, -n % _ROW), constant_values=-1.0)
    cand, count = _compact(_pack_words(padded >= t), cap)

    def fast(_):
      bits = lax.bitcast_convert_type(a[cand], jnp.int32)
      bits = jnp.where(jnp.arange(cap) < count, bits, -1)
      kth = _kth_largest_bits(bits, k)
      above = bits > kth
      tie = bits == kth
      ties = jnp.where(tie, cumsum(tie.astype(jnp.int32)), 0)  # 1-based rank among ties
      keep = above | ((ties > 0) & (ties <= k - jnp.sum(above)))
      keep = jnp.pad(keep, (0, -cap % _ROW))
      picked, _ = _compact(_pack_words(keep), k)
      return cand[picked]

    ok = (count >= k) & (count <= cap)
    return lax.cond(ok, fast, lambda _: _reference(a, k), None)

  return select(a)

