"""jaxcomm.testing catches broken codecs, each with a message that names what broke and the
numbers (every built-in codec passes it: tests/test_codecs.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxcomm import codecs, local, sync, testing


def _random_sign(stochastic: bool) -> codecs.Codec:
  """Unbiased 1-bit rounding between -m and m (m = max |x|): draws from its key."""
  def encode(x, key):
    m = jnp.max(jnp.abs(x))
    up = jax.random.bernoulli(key, (x / jnp.maximum(m, 1e-30) + 1) / 2)
    return codecs.pack_bits(up.astype(jnp.uint32), 1), m[None]

  def decode(p, n):
    up = codecs.unpack_bits(p[0], 1, n).astype(jnp.float32)
    return (2 * up - 1) * p[1][0]

  return codecs.Codec("random_sign", encode, decode,
                      payload_bytes=lambda n: codecs.packed_bytes(n, 1) + 4,
                      stochastic=stochastic, unbiased=True,
                      error_bound=lambda x: 2 * jnp.max(jnp.abs(x)))


def test_a_codec_of_ones_own_passes():
  testing.check_codec(_random_sign(stochastic=True))
  exact = codecs.Codec("f32", lambda x, key: (x,), lambda p, n: p[0], lambda n: 4 * n,
                       linear=True)  # no error bound: held to the identity codec
  testing.check_codec(exact)


def test_decoding_to_zeros_is_caught():
  # With the trivial bound max |x| (random-k's), the bound alone would let it pass.
  zeros = codecs.Codec("zeros", lambda x, key: (x[:1],), lambda p, n: jnp.zeros((n,)),
                       lambda n: 4, error_bound=lambda x: jnp.max(jnp.abs(x)))
  with pytest.raises(AssertionError, match=r"check_codec\(zeros\): for n = 1 "
                     r"\|\|decode\(encode\(x\)\) - x\|\| = 100 >= \|\|x\|\| = 100: the round "
                     r"trip is no closer to x than zeros"):
    testing.check_codec(zeros)
  # Without any bound it is held to the identity codec.
  with pytest.raises(AssertionError, match=r"states no error bound, so it is held to the "
                     r"identity codec .* max \|decode\(encode\(x\)\) - x\| = 100 at element 0"):
    testing.check_codec(dataclasses.replace(zeros, error_bound=None))


def test_a_false_linear_flag_is_caught():
  top = dataclasses.replace(codecs.top_k(0.1), linear=True)  # indices do not add up
  with pytest.raises(AssertionError, match=r"linear=True, but the payloads do not sum: for "
                     r"n = 1000, decode\(p1 \+ p2 \+ p3\) = .* while decode\(p1\) \+ "
                     r"decode\(p2\) \+ decode\(p3\) = .*set linear=False"):
    testing.check_codec(top)


def test_wrong_payload_bytes_are_caught_with_both_numbers():
  # sign(): 1 bit per element packed 8 per byte, and a float32 scale. n = 1: 1 + 4 bytes.
  short = dataclasses.replace(codecs.sign(), payload_bytes=lambda n: n // 8 + 4)
  with pytest.raises(AssertionError, match=r"payload_bytes\(1\) = 4, but encode\(f32\[1\]\) "
                     r"returns 5 bytes: \(uint8\[1\], float32\[1\]\)"):
    testing.check_codec(short)


def test_forgetting_stochastic_is_caught_and_named():
  forgot = _random_sign(stochastic=False)
  with pytest.raises(AssertionError, match=r"not stochastic, so its encode is called with "
                     r"key=None.*build the Codec with stochastic=True"):
    testing.check_codec(forgot)
  # The library says so too, where the codec is given to a transform (not a TypeError from
  # inside jax.random at the first step).
  with pytest.raises(ValueError, match="stochastic=True"):
    sync.compressed(forgot, memory="ef", axis_name=None)
  tx = local.diloco(optax.sgd(0.1), optax.sgd(1.0), 2, axis_name=None, codec=forgot)
  with pytest.raises(ValueError, match="stochastic=True"):
    tx.init({"w": jnp.zeros(3)})


def test_other_false_flags_are_named():
  nearest = dataclasses.replace(codecs.uniform(2, block=50), unbiased=True)
  with pytest.raises(AssertionError, match=r"unbiased=True, but the mean of 64 round trips"):
    testing.check_codec(nearest)
  low = dataclasses.replace(codecs.qsgd(3, bucket=100),
                            variance_bound=lambda x: 1e-3 * jnp.sum(x ** 2))
  with pytest.raises(AssertionError, match=r"variance_bound\(x\) = .* but the mean squared "
                     r"error of 64 round trips"):
    testing.check_codec(low)
  unshared = dataclasses.replace(codecs.random_k(0.1), shared_key=False)  # decode needs the key
  with pytest.raises(AssertionError, match=r"decode raised TypeError.*shared_key=True"):
    testing.check_codec(unshared)
  loose = dataclasses.replace(codecs.top_k(0.1), error_bound=lambda x: 0.0 * jnp.max(x))
  with pytest.raises(AssertionError, match=r"exceeds the error bound 0"):
    testing.check_codec(loose)


def test_wire_dtypes_are_checked():
  bools = codecs.Codec("bools", lambda x, key: (x > 0, jnp.max(jnp.abs(x))[None]),
                       lambda p, n: jnp.where(p[0], p[1][0], -p[1][0]),
                       lambda n: n + 4, error_bound=lambda x: 2 * jnp.max(jnp.abs(x)))
  with pytest.raises(AssertionError, match=r"payload leaf 0 is bool\[1\].*codecs.pack_bits"):
    testing.check_codec(bools)
  not_tuple = dataclasses.replace(codecs.identity(), encode=lambda x, key: x)
  with pytest.raises(AssertionError, match="must return a tuple"):
    testing.check_codec(not_tuple)


def test_transform_checks_state_expected_and_actual():
  with pytest.raises(AssertionError, match=r"did not converge: loss .* after 5 steps"):
    testing.check_converges_on_quadratic(optax.sgd(1e-4), steps=5)
