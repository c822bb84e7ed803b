"""Codecs on one device: exact payload bytes, wire formats, error bounds, unbiasedness, bad
input."""

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm import codecs, comm, testing

ZOO = testing.codec_zoo(whole=True)
N = 1000


@pytest.fixture(scope="module")
def vec():
  # Heavy-tailed, like gradients: a few large entries among many small ones.
  # Scaled to max |x| = 100 so that unscaled fp8 (max 448) does not overflow.
  k1, k2 = jax.random.split(jax.random.key(42))
  x = jax.random.normal(k1, (N,)) * jnp.exp(2.0 * jax.random.normal(k2, (N,)))
  return x * (100.0 / jnp.max(jnp.abs(x)))


def test_every_public_codec_is_in_the_zoo():
  """The zoo is every codec factory of `codecs.__all__` (a function returning a Codec that
  takes no codec: `for_tree` makes one from another), each with examples."""
  signature = lambda name: inspect.signature(getattr(codecs, name))
  public = {name for name in codecs.__all__ if inspect.isfunction(getattr(codecs, name))
            and str(signature(name).return_annotation) == "Codec"
            and "codec" not in signature(name).parameters}
  names = set(codecs.names())
  assert names == public, (
      f"codecs.names() misses {sorted(public - names)} (add its module to _FACTORY_MODULES in "
      f"jaxcomm/codecs/_load.py) and names {sorted(names - public)}, not in codecs.__all__")
  assert set(testing.CODEC_EXAMPLES) == public, (
      f"add example arguments to jaxcomm.testing.CODEC_EXAMPLES for "
      f"{sorted(public - set(testing.CODEC_EXAMPLES))}; remove "
      f"{sorted(set(testing.CODEC_EXAMPLES) - public)}")
  made = {name.split("(")[0] for name in ZOO}
  assert made == public, sorted(public - made)


@pytest.mark.parametrize("name", list(ZOO))
def test_every_codec_passes_the_contract(name, vec):
  codec = ZOO[name]
  if codec.length is not None:  # built for one length (given shapes): checked at it
    testing.check_codec(codec)
    return
  # Partial blocks and chunks, odd lengths, and the heavy-tailed vec (1000 elements).
  testing.check_codec(codec, vec, jax.random.key(1), lengths=(1, 37))
  # Past 4096 elements (uint16 -> uint32 indices, chunk counts): the bytes, from shapes only.
  assert comm.tree_bytes(codecs.payload_spec(codec, 4099)) == codec.payload_bytes(4099)


def test_wire_formats_are_narrow():
  spec = lambda c, n: [x.dtype for x in jax.eval_shape(
      c.encode, jax.ShapeDtypeStruct((n,), jnp.float32), jax.random.key(0))]
  assert spec(codecs.sign(), 64) == [jnp.uint8, jnp.float32]
  assert codecs.sign().payload_bytes(64) == 8 + 4  # 1 bit per element, packed 8 per byte
  assert codecs.fp4(block=None).payload_bytes(64) == 32 + 4  # 2 codes per byte
  assert codecs.uniform(3, block=None).payload_bytes(64) == 24 + 4  # a 3-bit stream, a scale
  assert codecs.uniform(3, block=None, symmetric=False).payload_bytes(64) == 24 + 8  # lo, step
  assert spec(codecs.top_k(k=4, chunk=64), 1000)[1] == jnp.uint8  # chunk-local indices
  assert spec(codecs.top_k(k=4), 1000)[1] == jnp.uint16
  assert spec(codecs.top_k(k=4), 70000)[1] == jnp.uint32
  assert spec(codecs.dct_top_k(), 1000) == [jnp.float32, jnp.uint8]
  assert spec(codecs.random_k(k=3), 100) == [jnp.float32]  # shared key: values only
  # Own key: one offset per stratum of n/k elements travels, not a full index.
  assert spec(codecs.random_k(0.01, shared_key=False), 10000) == [jnp.float32, jnp.uint8]
  assert spec(codecs.fp8(), 10) == [jnp.float8_e4m3fn, jnp.float32]
  assert codecs.qsgd(7, bucket=None).payload_bytes(10) == 5 + 4  # sign + 3 level bits


@pytest.mark.parametrize("bits", list(range(1, 17)))
def test_pack_unpack_roundtrip(bits):
  m = 37
  codes = np.random.default_rng(bits).integers(0, 2 ** bits, m).astype(np.uint32)
  packed, back = jax.jit(lambda c: (codecs.pack_bits(c, bits),
                                    codecs.unpack_bits(codecs.pack_bits(c, bits), bits, m)))(codes)
  assert packed.dtype == jnp.uint8 and packed.shape == (math.ceil(m * bits / 8),)
  np.testing.assert_array_equal(back, codes)


def _rt(codec, x, key=None):
  return jax.jit(codec.roundtrip)(x, key)


def test_exact_round_trips(vec):
  np.testing.assert_array_equal(_rt(codecs.identity(), vec), vec)
  np.testing.assert_array_equal(_rt(codecs.cast("float32"), vec), vec)
  np.testing.assert_array_equal(_rt(codecs.top_k(1.0), vec), vec)
  # DCT: orthonormal, so keeping every coefficient is an exact round trip (float32 rounding).
  for chunk in (64, 7):
    out = _rt(codecs.dct_top_k(chunk=chunk, k=chunk), vec)
    np.testing.assert_allclose(out, vec, atol=1e-5 * float(jnp.max(jnp.abs(vec))))
  d = codecs.dct_matrix(64)
  np.testing.assert_allclose(d @ d.T, np.eye(64), atol=1e-6)
  # Against the textbook DCT-II definition (scipy's norm="ortho").
  x = np.asarray(vec[:64], np.float64)
  i = np.arange(64)
  ref = np.array([np.sum(x * np.cos(np.pi * u * (2 * i + 1) / 128)) for u in range(64)])
  ref *= np.sqrt(2 / 64) * np.where(i == 0, 1 / np.sqrt(2), 1.0)
  np.testing.assert_allclose(d @ x, ref, atol=1e-4)
  # Dropping coefficients loses exactly their energy (Parseval).
  c = codecs.dct_top_k(chunk=64, k=8)
  err = np.asarray(vec[:64] - _rt(c, vec[:64]), np.float64)
  coef = np.sort(np.abs(d @ x))[::-1]
  np.testing.assert_allclose(np.sum(err ** 2), np.sum(coef[8:] ** 2), rtol=1e-4)


def test_tiled_dct_is_demo_transform(vec):
  """DeMo's per-tensor tiling: each dimension in chunks of its largest divisor <= chunk, a
  2-D DCT per tile of a matrix, the k largest coefficients per tile."""
  shapes = [(12, 20), (20,), (2, 3, 5), ()]  # tiles 6 x 10; 1 x 10; 6 x 5; 1 x 1
  n = sum(math.prod(s) for s in shapes)
  x = vec[:n]
  full = codecs.tiled_dct_top_k(shapes, chunk=10, k=100)
  np.testing.assert_allclose(_rt(full, x), x, atol=1e-5 * float(jnp.max(jnp.abs(x))))
  c = codecs.tiled_dct_top_k(shapes, chunk=10, k=3)
  assert [codecs.largest_divisor(r, 10) for r in (12, 20, 6, 5, 1)] == [6, 10, 6, 5, 1]
  # Reference: numpy 2-D DCT of each tile, keep the 3 largest, invert.
  want, offset = [], 0
  for shape, (a, b) in zip(shapes, [(6, 10), (1, 10), (6, 5), (1, 1)]):
    size = math.prod(shape)
    rows = size // (shape[-1] if shape else 1)
    m = np.asarray(x[offset:offset + size], np.float64).reshape(rows, -1)
    offset += size
    da, db = codecs.dct_matrix(a).astype(np.float64), codecs.dct_matrix(b).astype(np.float64)
    out = np.zeros_like(m)
    for i in range(0, m.shape[0], a):
      for j in range(0, m.shape[1], b):
        coef = da @ m[i:i + a, j:j + b] @ db.T
        keep = np.argsort(-np.abs(coef).ravel())[:min(3, a * b)]
        kept = np.zeros(a * b)
        kept[keep] = coef.ravel()[keep]
        out[i:i + a, j:j + b] = da.T @ kept.reshape(a, b) @ db
    want.append(out.ravel())
  np.testing.assert_allclose(_rt(c, x), np.concatenate(want), atol=1e-4)
  # Bytes: 3 (f32 value, u8 index) pairs per tile of 4 + 2 + 1 tiles, 1 for the scalar.
  payload = c.encode(x, None)
  assert [p.dtype for p in payload] == [jnp.float32, jnp.uint8]
  assert comm.tree_bytes(payload) == c.payload_bytes(n) == (4 * 3 + 2 * 3 + 1 * 3 + 1) * 5
  assert float(jnp.max(jnp.abs(_rt(c, x) - x))) <= float(c.error_bound(x))
  with pytest.raises(ValueError, match="built for"):
    c.encode(vec, None)
  for bad, word in [(dict(chunk=0), "chunk"), (dict(k=0), "k")]:
    with pytest.raises(ValueError, match=word):
      codecs.tiled_dct_top_k(shapes, **{"chunk": 10, "k": 3, **bad})


def test_top_k_and_random_k_select_what_they_say(vec):
  out = _rt(codecs.top_k(k=50), vec)
  kept = np.flatnonzero(np.asarray(out))
  np.testing.assert_array_equal(np.sort(kept), np.sort(np.argsort(-np.abs(vec))[:50]))
  chunked = np.asarray(_rt(codecs.top_k(k=2, chunk=100), vec)).reshape(10, 100)
  assert (np.count_nonzero(chunked, axis=1) == 2).all()
  key = jax.random.key(3)
  a = _rt(codecs.random_k(k=100), vec, key)
  b = _rt(codecs.random_k(k=100, shared_key=False), vec, key)
  np.testing.assert_array_equal(a, b)  # same key, same coordinates, indices travel or not
  assert np.count_nonzero(a) == 100
  kept = np.flatnonzero(a)
  np.testing.assert_array_equal(np.asarray(a)[kept], np.asarray(vec)[kept])
  r = _rt(codecs.rtop_k(100, 10), vec, key)
  top100 = set(np.argsort(-np.abs(vec))[:100].tolist())
  assert np.count_nonzero(r) == 10 and set(np.flatnonzero(r).tolist()) <= top100


@pytest.mark.parametrize("codec", [codecs.qsgd(3, bucket=100),
                                   codecs.uniform(2, stochastic=True, block=50),
                                   codecs.uniform(1, stochastic=True, block=50, symmetric=False),
                                   codecs.fp4(block=50, stochastic=True)],
                         ids=lambda c: c.name)
def test_stochastic_codecs_are_unbiased(codec, vec):
  """Mean of K draws: E||mean - x||^2 <= V / K with V the variance bound; 4x leaves room.

  A biased codec fails it: nearest rounding of the same grid has a squared bias far above V/K.
  """
  x = vec[:200]
  k = 1024
  # K copies of x in one vector: blocks align with the copies, so each copy is an
  # independent draw with the same scales (one compile instead of a vmap over keys).
  draws = _rt(codec, jnp.tile(x, k), jax.random.key(7)).reshape(k, -1)
  v = float(jax.jit(codec.variance_bound)(x))
  assert codec.unbiased and v > 0
  draws, x = np.asarray(draws, np.float64), np.asarray(x, np.float64)
  mse = float(np.mean(np.sum((draws - x) ** 2, axis=1)))
  assert mse <= v, (mse, v)  # the variance bound holds
  bias2 = float(np.sum((np.mean(draws, axis=0) - x) ** 2))
  assert bias2 <= 4 * v / k, (bias2, v / k)
  assert mse > 20 * v / k  # ... and the test could tell a biased codec apart


def test_bad_input():
  bad = [
      (lambda: codecs.uniform(0), "bits"), (lambda: codecs.uniform(17), "bits"),
      (lambda: codecs.uniform(1), "bits"),  # a symmetric grid needs a sign and a level
      (lambda: codecs.uniform(2.5), "bits"), (lambda: codecs.uniform(4, block=0), "block"),
      (lambda: codecs.qsgd(0), "levels"), (lambda: codecs.qsgd(2 ** 15), "levels"),
      (lambda: codecs.qsgd(4, bucket=-1), "bucket"),
      (lambda: codecs.log_quant(1), "bits"), (lambda: codecs.log_quant(4, alpha=0.0), "alpha"),
      (lambda: codecs.top_k(0.0), "fraction"), (lambda: codecs.top_k(1.5), "fraction"),
      (lambda: codecs.top_k(), "fraction"), (lambda: codecs.top_k(0.1, k=3), "fraction"),
      (lambda: codecs.top_k(k=0), "k"), (lambda: codecs.top_k(k=65, chunk=64), "chunk"),
      (lambda: codecs.random_k(2.0), "fraction"), (lambda: codecs.random_k(k=-1), "k"),
      (lambda: codecs.rtop_k(10, 20), "k"), (lambda: codecs.rtop_k(0.0, 0.1), "r"),
      (lambda: codecs.dct_top_k(64, 65), "k"), (lambda: codecs.dct_top_k(0, 1), "chunk"),
      (lambda: codecs.fp8("e3m4"), "fmt"), (lambda: codecs.fp4(block=0), "block"),
      (lambda: codecs.cast("int8"), "dtype"),
  ]
  for make, word in bad:
    with pytest.raises(ValueError, match=word):
      make()
  x = jnp.ones(10)
  with pytest.raises(ValueError, match="key"):
    codecs.qsgd().encode(x, None)
  with pytest.raises(ValueError, match="key"):
    codecs.random_k(k=2).encode(x, None)
  with pytest.raises(ValueError, match="k=20"):
    codecs.top_k(k=20).encode(x, None)  # more than the vector holds (static, at trace time)


# ------------------------------------------------------------------ codecs by name
_MY_CODEC = '''
from jaxcomm import codecs

def codec(scale=1.0):
  """Sends x / scale in bfloat16 (a codec of one's own, as a user would save it)."""
  cast = codecs.cast("bfloat16")
  return codecs.Codec(f"scaled({scale})", lambda x, key: cast.encode(x / scale, key),
                      lambda p, n: cast.decode(p, n) * scale, cast.payload_bytes)
'''


def test_codecs_load_by_name_module_path_or_file(tmp_path, monkeypatch):
  """One vocabulary for codec specs: a factory here, a module's `codec`, a module's function,
  or a .py file's `codec`, with the arguments after the colon."""
  assert codecs.parse("uniform:4,block=64").name == codecs.uniform(4, block=64).name
  assert codecs.parse("fp8:fmt=e5m2,block=none").name == codecs.fp8("e5m2", block=None).name
  assert codecs.parse(" none ") is None and codecs.parse(None) is None
  assert codecs.load("jaxcomm.codecs.sign") is codecs.sign
  (tmp_path / "my_codec.py").write_text(_MY_CODEC)
  from_file = codecs.parse(f"{tmp_path / 'my_codec.py'}:scale=4")
  monkeypatch.syspath_prepend(str(tmp_path))
  for codec in (from_file, codecs.parse("my_codec.codec:4")):  # module path: its function
    assert codec.name == "scaled(4)" and codec.payload_bytes(10) == 20
    np.testing.assert_allclose(codec.roundtrip(jnp.array([4.0, -8.0])), [4.0, -8.0])
  testing.check_codec(from_file, lengths=(37,), error_bound=lambda x: 0.01 * jnp.max(jnp.abs(x)))


@pytest.mark.parametrize("spec,words", [
    ("zip", "codec must be one of 'cast', .*, a module path or a .py file, as name or "
            "name:arg,key=value; got 'zip'"),
    ("no_such_pkg.mod", "codec must be one of .*; got 'no_such_pkg.mod'"),
    ("top_k:fractoin=0.1", r"codec 'top_k:fractoin=0.1': got an unexpected keyword argument "
                           r"'fractoin' \(the arguments of codec top_k\(fraction"),
    ("uniform:bits=99", r"codec 'uniform:bits=99': bits must be an integer in \[1, 16\]"),
    ("missing.py", "codec 'missing.py': no such file"),
    ("jaxcomm.codecs.packed_bytes:8,2", "returned int, not a jaxcomm.codecs.Codec or a "),
    ("jaxcomm.comm", "must define a function codec"),
])
def test_codec_specs_fail_naming_the_setting(spec, words):
  with pytest.raises(ValueError, match=words):
    codecs.parse(spec)
