"""The codecs' fast paths against the slow implementations they replaced (kept here as the
references): packing, counter-based stochastic rounding, compare-based quantisers, sort-free
top-k selection and one-pass decoding of many payloads, on random and adversarial inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs
from jaxcomm.codecs import _bits, _random, _select, _sparse
from tests import contract

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
N_BIG = (1 << 16) + 37  # the sort-free selection starts at 2**15; not a multiple of 32


def _inputs(n, seed=0):
  """Random heavy-tailed values and the adversarial cases every fast path must survive."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (n,)) * jnp.exp(2.0 * jax.random.normal(k2, (n,)))
  i = jnp.arange(n)
  return {
      "random": x,
      "zeros": jnp.zeros((n,)),
      "all_equal": jnp.full((n,), -2.5),
      "ties": jnp.round(x * 2) / 2,  # many exact ties, values on a half grid
      "sorted": jnp.sort(jnp.abs(x)),
      "periodic": jnp.where(i % 64 == 3, 7.0, 0.01 * x),  # defeats a strided sample
      "huge": jnp.where(i % 5 == 0, 3e38, x),
      "tiny": x * 1e-40,  # subnormal
  }


# ------------------------------------------------------------------------------ packing
def _pack_stream(codes, bits):
  """The previous pack_bits: every code expanded to bits, 8 stream bits summed per byte."""
  stream = ((codes[:, None].astype(jnp.uint32) >> jnp.arange(bits, dtype=jnp.uint32)) & 1)
  stream = stream.reshape(-1)
  stream = jnp.pad(stream, (0, -stream.shape[0] % 8)).reshape(-1, 8)
  return jnp.sum(stream << jnp.arange(8, dtype=jnp.uint32), axis=1,
                 dtype=jnp.uint32).astype(jnp.uint8)


def test_pack_bits_is_the_little_endian_stream():
  rng = np.random.default_rng(0)
  for m in (13, 1001):  # partial groups of lcm(bits, 8) bits
    codes = [rng.integers(0, 2 ** b, m).astype(np.uint32) for b in range(1, 17)]
    both = jax.jit(lambda cs: [(codecs.pack_bits(c, b), _pack_stream(c, b),
                                codecs.unpack_bits(codecs.pack_bits(c, b), b, m))
                               for b, c in enumerate(cs, start=1)])
    for c, (packed, stream, back) in zip(codes, both(codes)):
      np.testing.assert_array_equal(packed, stream)
      np.testing.assert_array_equal(back, c)


# ------------------------------------------------------------------------------ random
def test_counter_based_uniforms_are_uniform_and_independent():
  n = 1 << 20
  draw = jax.jit(lambda key: _random.uniform(key, (n,)))
  u = np.asarray(draw(jax.random.key(5)), np.float64)
  v = np.asarray(draw(jax.random.key(6)), np.float64)
  assert u.min() >= 0.0 and u.max() < 1.0
  sd = math.sqrt(1 / 12 / n)  # of the mean of n uniforms
  assert abs(u.mean() - 0.5) < 5 * sd and abs(u.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
  counts = np.histogram(u, bins=256, range=(0, 1))[0]
  chi2 = np.sum((counts - n / 256) ** 2 / (n / 256))  # 255 degrees of freedom: sd 22.6
  assert chi2 < 255 + 6 * 22.6, chi2
  pairs = np.histogram2d(u[0::2], u[1::2], bins=16, range=((0, 1), (0, 1)))[0]
  chi2 = np.sum((pairs - n / 2 / 256) ** 2 / (n / 2 / 256))  # neighbours: 255 dof
  assert chi2 < 255 + 6 * 22.6, chi2
  for a, b in [(u[:-1], u[1:]), (u, v)]:  # neighbours and keys uncorrelated
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(n)
  np.testing.assert_array_equal(draw(jax.random.key(5)), u.astype(np.float32))
  batched = jax.vmap(lambda k: _random.uniform(k, (4,)))(jax.random.split(jax.random.key(0), 3))
  assert len({tuple(np.asarray(r).tolist()) for r in batched}) == 3


# ------------------------------------------------------------------------------ quantisers
def _fp4_ref(x, block, u=None):
  """The previous fp4: comparisons against the grid summed over a new axis, a gather."""
  xb, _ = _bits.blocks(x, block)
  scale = jnp.max(jnp.abs(xb), axis=1) / 6.0
  v = jnp.abs(xb) / jnp.where(scale > 0, scale, 1.0)[:, None]
  grid = jnp.asarray(E2M1)
  if u is None:
    idx = jnp.sum(v[..., None] > (grid[1:] + grid[:-1]) / 2, axis=-1)
  else:
    lo = jnp.clip(jnp.sum(v[..., None] >= grid[1:], axis=-1), 0, 6)
    idx = lo + (u.reshape(v.shape) < (v - grid[lo]) / (grid[lo + 1] - grid[lo]))
  mag = grid[idx] * scale[:, None]
  return _bits.unblock(jnp.where(xb < 0, -mag, mag), x.shape[0])


def _log_quant_ref(x, bits, alpha, block):
  """The previous log_quant: log1p per element, round, expm1 per element."""
  levels, log1p_a = 2 ** (bits - 1) - 1, math.log1p(alpha)
  xb, _ = _bits.blocks(x, block)
  m = jnp.max(jnp.abs(xb), axis=1)
  q = jnp.log1p(alpha * jnp.abs(xb) / jnp.where(m > 0, m, 1.0)[:, None]) / log1p_a
  lv = jnp.clip(jnp.round(q * levels), 0, levels)
  mag = jnp.expm1(lv / levels * log1p_a) / alpha * m[:, None]
  return _bits.unblock(jnp.where(xb < 0, -mag, mag), x.shape[0]), q * levels


def _masked_ref(x, block, symmetric_sign):
  """The previous asymmetric grid (masked min / max) or sign scale (masked count)."""
  xb, valid = _bits.blocks(x, block)
  if symmetric_sign:
    return jnp.sum(jnp.abs(xb), axis=1) / jnp.sum(valid, axis=1)
  lo = jnp.min(jnp.where(valid, xb, jnp.inf), axis=1)
  hi = jnp.max(jnp.where(valid, xb, -jnp.inf), axis=1)
  return lo, (hi - lo) / 15


def test_quantiser_fast_paths_equal_the_old_formulas():
  """Every adversarial input at once (vmapped over the kinds: one compile per codec).

  Decoded values are compared to within an ulp (XLA may turn a division by a constant into
  a multiplication in one program and not in another); a wrong code is a grid step off.
  """
  n = 1000  # not a multiple of the blocks below
  xs = jnp.stack([jnp.where(jnp.isfinite(v), v, 0.0) for v in _inputs(n, seed=3).values()])
  key = jax.random.key(4)
  keys = jax.random.split(key, xs.shape[0])
  same = lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-7, atol=0)
  batch = lambda f, *a: jax.jit(jax.vmap(f))(*a)
  for block in (32, 30, None):
    same(batch(codecs.fp4(block=block).roundtrip, xs), batch(lambda x: _fp4_ref(x, block), xs))
  stochastic = codecs.fp4(block=32, stochastic=True)
  u = lambda k: _random.uniform(k, _bits.blocks(xs[0], 32)[0].shape)
  same(batch(stochastic.roundtrip, xs, keys), batch(lambda x, k: _fp4_ref(x, 32, u(k)), xs, keys))
  for bits, alpha, block in [(4, 10.0, 256), (5, 3.0, 100), (2, 10.0, None), (7, 10.0, 64)]:
    ref, ql = batch(lambda x: _log_quant_ref(x, bits, alpha, block), xs)
    got = batch(codecs.log_quant(bits, alpha, block=block).roundtrip, xs)
    close = np.isclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=0)
    # Midpoints compare exactly now; log1p's rounding decided them before.
    ql = np.asarray(ql).reshape(xs.shape[0], -1)[:, :n]
    at_mid = np.abs(ql - np.floor(ql) - 0.5) < 1e-5
    assert np.all(close | at_mid), (bits, alpha, block)
  for block in (256, 300, None):
    lo, step = batch(lambda x: codecs.uniform(4, block=block, symmetric=False).encode(x, None)[1:],
                     xs)
    ref_lo, ref_step = batch(lambda x: _masked_ref(x, block, False), xs)
    np.testing.assert_array_equal(lo, ref_lo)
    same(step, ref_step)
    same(batch(lambda x: codecs.sign(block=block).encode(x, None)[1], xs),
         batch(lambda x: _masked_ref(x, block, True), xs))


def test_log_quant_midpoints_are_exact():
  """The compare-based levels are the nearest in the log domain, decided in float64."""
  alpha, bits = 10.0, 4
  levels = 2 ** (bits - 1) - 1
  r = np.linspace(0, 1, 20001, dtype=np.float32)  # |x| / m on a fine grid, m = 1
  x = jnp.concatenate([jnp.ones(1), jnp.asarray(r)])
  codes = codecs.unpack_bits(codecs.log_quant(bits, alpha).encode(x, None)[0], bits, x.shape[0])
  q = np.log1p(alpha * r.astype(np.float64)) / math.log1p(alpha) * levels
  np.testing.assert_array_equal(np.asarray(codes)[1:] & levels, np.floor(q + 0.5))


# ------------------------------------------------------------------------------ top-k
def _top_k_ref(a, k):
  return jnp.sort(lax.top_k(a, k)[1])


def test_sort_free_top_k_is_lax_top_k():
  """All adversarial inputs at once (vmap runs the selection per vector, fallback included)."""
  a = jnp.abs(jnp.stack(list(_inputs(N_BIG).values())))
  for k in (N_BIG // 100, N_BIG // 20, 700):
    got = jax.jit(jax.vmap(lambda v: _select.top_k_indices(v, k)))(a)
    np.testing.assert_array_equal(got, jax.jit(jax.vmap(lambda v: _top_k_ref(v, k)))(a))


def test_sort_free_top_k_pieces():
  rng = np.random.default_rng(0)
  counts = rng.integers(0, 33, 5000).astype(np.int32)
  np.testing.assert_array_equal(_select.cumsum(jnp.asarray(counts)), np.cumsum(counts))
  words = rng.integers(0, 2 ** 32, 300, dtype=np.uint64).astype(np.uint32)
  pos, count = _select._compact(jnp.asarray(words), 6000)
  bits = np.unpackbits(words.view(np.uint8), bitorder="little")
  np.testing.assert_array_equal(np.asarray(pos)[:int(count)], np.flatnonzero(bits))
  vals = rng.integers(0, 2 ** 31 - 1, 999).astype(np.int32)
  for k in (1, 500, 999):
    kth = _select._kth_largest_bits(jnp.asarray(vals), k)
    assert int(kth) == np.sort(vals)[::-1][k - 1]
  assert _select._plan(N_BIG, N_BIG // 100) is not None


def test_sort_free_top_k_under_vmap_and_shard_map(mesh8):
  xs = jnp.abs(jax.random.normal(jax.random.key(1), (8, 1 << 15)))
  xs = xs.at[3].set(jnp.where(jnp.arange(1 << 15) % 64 == 0, 5.0, 0.0))  # one falls back
  k = 300
  ref = jax.vmap(lambda v: _top_k_ref(v, k))(xs)
  np.testing.assert_array_equal(jax.jit(jax.vmap(lambda v: _select.top_k_indices(v, k)))(xs), ref)
  f = jax.shard_map(lambda v: _select.top_k_indices(v[0], k)[None], mesh=mesh8,
                    in_specs=P("data"), out_specs=P("data"))
  np.testing.assert_array_equal(jax.jit(f)(xs), ref)


def test_top_k_and_rtop_k_codecs_keep_their_meaning():
  x = _inputs(N_BIG, seed=7)["ties"]
  key = jax.random.key(2)
  c = codecs.top_k(0.01)
  vals, idx = c.encode(x, None)
  k = vals.shape[0]
  ref = np.asarray(_top_k_ref(jnp.abs(x), k))
  np.testing.assert_array_equal(idx, ref)  # the k largest |x|, ties to the lowest index
  np.testing.assert_array_equal(vals, np.asarray(x)[ref])
  # rtop_k: the top r by rank as lax.top_k orders them, then the same strata as before.
  r = codecs.rtop_k(0.04, 0.01)
  rr = max(1, round(0.04 * N_BIG))
  top = lax.top_k(jnp.abs(x), rr)[1]
  st = _sparse._Strata(rr, k)
  want = top[st.indices(st.offsets(key))]
  np.testing.assert_array_equal(r.encode(x, key)[1], want)


# ------------------------------------------------------------------------------ decode_sum
@pytest.mark.parametrize("codec", [
    codecs.top_k(0.02), codecs.top_k(k=3, chunk=64), codecs.rtop_k(0.1, 0.02),
    codecs.random_k(0.05, shared_key=False), codecs.dct_top_k(64, 8),
    codecs.tiled_dct_top_k([(64, 24), (24,), (3, 8, 24), (5,)], chunk=16, k=5)],
    ids=lambda c: c.name)
def test_decode_sum_is_the_sum_of_decodes(codec):
  n, w = 64 * 24 + 24 + 3 * 8 * 24 + 5, 5
  xs = jax.random.normal(jax.random.key(9), (w, n))
  keys = jax.random.split(jax.random.key(3), w)
  payloads = jax.vmap(codec.encode)(xs, keys)
  loop = sum(codec.decode(jax.tree.map(lambda p: p[i], payloads), n) for i in range(w))
  got = jax.jit(lambda p: codec.decode_sum(p, n))(payloads)
  np.testing.assert_allclose(got, loop, rtol=1e-5, atol=1e-5 * float(jnp.abs(loop).max()))
  one = jax.tree.map(lambda p: p[:1], payloads)
  np.testing.assert_allclose(codec.decode_sum(one, n), codec.decode(
      jax.tree.map(lambda p: p[0], payloads), n), rtol=1e-6, atol=1e-6)


def test_rtop_k_in_index_order_samples_the_top_r():
  """order="index": strata over the top r in index order; same top r, same payload format."""
  n, r, k = 2000, 100, 10
  x = jax.random.normal(jax.random.key(4), (n,))
  c = codecs.rtop_k(r / n, k / n, order="index")  # fractions: check_codec also tries n = 1
  contract.check_codec(c, x, jax.random.key(0))
  top = np.sort(np.asarray(lax.top_k(jnp.abs(x), r)[1]))
  keys = jax.random.split(jax.random.key(1), 4000)
  idx = np.asarray(jax.jit(jax.vmap(lambda key: c.encode(x, key)[1]))(keys))
  assert set(idx.ravel().tolist()) <= set(top.tolist())
  assert all(len(set(row)) == k for row in idx.tolist())  # distinct picks
  st = _sparse._Strata(r, k)
  np.testing.assert_array_equal(idx[0], top[st.indices(st.offsets(keys[0]))])
  freq = np.bincount(np.searchsorted(top, idx.ravel()), minlength=r) / len(keys)
  np.testing.assert_allclose(freq, k / r, atol=5 * math.sqrt(k / r / len(keys)))
  with pytest.raises(ValueError, match="order"):
    codecs.rtop_k(r, k, order="magnitude")
