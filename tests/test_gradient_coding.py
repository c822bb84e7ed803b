"""Gradient coding: exact for every straggler pattern of size s; approximate and quantised."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, sync, train

W = 8
D = 33


def _partition_grads(seed=0):
  return np.random.default_rng(seed).normal(size=(W, D)).astype(np.float32)  # one per partition


def _coded(code, parts):
  """What worker i sends: the gradient of the mean loss over its s + 1 partitions."""
  return np.stack([parts[code.partitions(i)].mean(0) for i in range(W)])


def _decoder(mesh, code, **kwargs):
  record = {}

  def body(coded, stragglers):
    out, nbytes, recovered = sync.decode_gradient(coded[0], code, stragglers, "data", **kwargs)
    record["bytes"] = nbytes
    return out, recovered

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P(), P())))
  return f, record


@pytest.mark.parametrize("s", [1, 3, 7])
def test_exact_for_every_straggler_pattern_of_size_s(mesh8, s):
  code = sync.fractional_repetition(W, s)
  parts = _partition_grads(s)
  full = parts.astype(np.float64).mean(0)
  decode, record = _decoder(mesh8, code)
  coded = _coded(code, parts)
  patterns = list(itertools.combinations(range(W), s))
  assert len(patterns) == {1: 8, 3: 56, 7: 8}[s]
  for stragglers in patterns:
    mask = np.zeros(W, bool)
    mask[list(stragglers)] = True
    out, recovered = decode(coded, mask)
    np.testing.assert_allclose(out, full, rtol=1e-5, atol=1e-6, err_msg=str(stragglers))
    assert recovered == code.num_groups
  assert record["bytes"] == 2 * (W - 1) / W * D * 4  # all-reduce of the weighted f32[D]
  assert comm.inspect(decode, coded, mask, mesh=mesh8).wire_bytes() == record["bytes"]


def test_approximate_decoding_with_more_stragglers_and_quantised_gradients(mesh8):
  code = sync.fractional_repetition(W, 1)
  parts = _partition_grads(11)
  coded = _coded(code, parts)
  decode, _ = _decoder(mesh8, code, approximate=True)
  for stragglers in itertools.combinations(range(W), 3):  # more than s = 1: groups may be lost
    mask = np.zeros(W, bool)
    mask[list(stragglers)] = True
    lost = {i // 2 for i in stragglers if (i ^ 1) in stragglers}  # both members straggle
    kept = [g for g in range(code.num_groups) if g not in lost]
    ref = parts.reshape(code.num_groups, 2, D)[kept].astype(np.float64).mean((0, 1))
    out, recovered = decode(coded, mask)
    assert recovered == len(kept)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
  # Quantised partial gradients: bf16 payloads by all-gather, error within the codec's bound.
  codec = codecs.cast("bfloat16")
  decode, record = _decoder(mesh8, code, codec=codec, key=jax.random.PRNGKey(0))
  mask = np.zeros(W, bool)
  mask[5] = True
  out, _ = decode(coded, mask)
  full = parts.astype(np.float64).mean(0)
  bound = 2 / W * np.abs(coded).max() * float(jnp.finfo(jnp.bfloat16).eps) * code.num_groups
  assert 0 < np.abs(out - full).max() <= bound
  assert record["bytes"] == (W - 1) * D * 2 == \
      comm.inspect(decode, coded, mask, mesh=mesh8).wire_bytes()  # all-gather of bf16[D]


def test_trainer_with_gradient_coding_equals_exact_data_parallel(mesh8):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(64, 10)) * 0.1, jnp.float32),
            "b": jnp.zeros(10)}

  def loss(p, b):  # a softmax classifier: small to compile, non-linear in the parameters
    logits = jnp.tanh(b["x"] @ p["w"]) + p["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  code = sync.fractional_repetition(W, 3)
  coded = train.Trainer(loss, optax.chain(sync.gradient_coding(code), optax.sgd(0.5)), mesh8)
  exact = train.Trainer(loss, optax.chain(sync.mean("data"), optax.sgd(0.5)), mesh8)
  s_coded, s_exact = coded.init(params), exact.init(params)
  patterns = set()
  for _ in range(4):
    batch = {"x": rng.random((64, 64), np.float32), "y": rng.integers(0, 10, 64, np.int32)}
    placed = code.place(batch)  # each worker holds its group's 4 partitions
    s_coded, _, sent = coded.step_fn(s_coded, placed)(s_coded, placed)
    s_exact, _, _ = exact.step_fn(s_exact, batch)(s_exact, batch)
    jax.block_until_ready((s_coded, s_exact))
    stragglers = np.asarray(s_coded.opt_state[0].stragglers)
    assert stragglers.sum() == 3
    patterns.add(tuple(np.nonzero(stragglers)[0]))
  assert len(patterns) > 1  # a new pattern every step
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               s_coded.params, s_exact.params)
  assert int(sent) == 4550  # all-reduce of 64 x 10 + 10 = 650 f32: 2 * 7/8 * 2600


def test_bad_input_fails_at_build():
  with pytest.raises(ValueError, match=r"stragglers must be in \[0, num_workers - 1\]"):
    sync.fractional_repetition(8, 8)
  with pytest.raises(ValueError, match="stragglers must be in"):
    sync.fractional_repetition(8, -1)
  with pytest.raises(ValueError, match="does not divide"):
    sync.fractional_repetition(8, 2)
  code = sync.fractional_repetition(8, 1)
  with pytest.raises(ValueError, match="approximate=True"):
    sync.gradient_coding(code, num_stragglers=2)
  with pytest.raises(ValueError, match="num_stragglers"):
    sync.gradient_coding(code, num_stragglers=8, approximate=True)
  with pytest.raises(ValueError, match="divisible"):
    code.place({"x": np.zeros((12, 2))})
