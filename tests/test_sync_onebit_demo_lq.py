"""sync.onebit_adam, sync.demo, sync.lq_sgd: exactness against references, bytes, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm import codecs, comm, sync, testing, train
from tests import contract

W = 8


@pytest.fixture(scope="module")
def task():
  return contract.digits_task(4)


_run = contract.run_steps
_flat = contract.flat


def _gram_schmidt(p):
  q, r = np.linalg.qr(p)
  return (q * np.sign(np.diag(r))).astype(np.float32)


def _n(params):
  return sum(x.size for x in jax.tree.leaves(params))


# ---------------------------------------------------------------------------- bytes
# Bytes worked out by hand (docs/algorithms.md) for testing.example_params: w f32[3, 4],
# b f32[4], n = 16 elements, W = 8.
# 1-bit Adam after the freeze: two-phase, chunks of 2: 2 sign bits in 1 byte + one f32 scale
# = 5 bytes, 7 times in each phase: 2 * 7 * 5.
ONEBIT_EXAMPLE = 70
# DeMo, chunk 4, k 2: w is one 3 x 4 tile (divisors 3 and 4), b one 1 x 4 tile; 2 (f32 value,
# u8 index) pairs each: 4 x 5 = 20 bytes, all-gathered: 7 * 20.
DEMO_EXAMPLE = 140
# LQ-SGD rank 1, 4 bits: b averaged exactly (f32 all-reduce of 16 bytes: 2 * 7/8 * 16 = 28);
# P has 3 elements, Q 4. Two-phase: chunks of 1: a 4-bit code (1 byte) + one f32 scale = 5
# bytes, 2 * 7 * 5 = 70 for P and again for Q. Gather: 3 codes = 2 bytes + 4 = 6 (P) and
# 4 codes = 2 bytes + 4 = 6 (Q), 7 * 6 each.
LQ_EXAMPLE = {"two_phase": 28 + 70 + 70, "gather": 28 + 42 + 42}
# digits MLP: n = 64 x 16 + 16 + 16 x 10 + 10 = 1210. Before the freeze an f32 all-reduce,
# 2 * 7/8 * 4840 = 8470; after it chunks of 152 (= ceil(1210 / 8)): 19 bytes of sign bits +
# 4 = 23 bytes, 2 * 7 * 23 = 322.
ONEBIT_DIGITS = {"exact": 8470, "onebit": 322}


def test_bytes_counted_equal_inspect_and_formula(mesh8):
  cases = [
      (sync.onebit_adam(0.01, freeze_step=0), ONEBIT_EXAMPLE),
      (sync.demo(0.01, chunk=4, k=2), DEMO_EXAMPLE),
      (optax.chain(sync.lq_sgd(1, bits=4, min_compression_rate=0), optax.sgd(0.1)),
       LQ_EXAMPLE["two_phase"]),
      (optax.chain(sync.lq_sgd(1, bits=4, min_compression_rate=0, collective="gather"),
                   optax.sgd(0.1)), LQ_EXAMPLE["gather"]),
  ]
  for tx, want in cases:
    _, _, m, _ = testing.check_on_mesh(tx, mesh8)  # asserts counted == comm.inspect
    assert int(m["wire_bytes"]) == want


def test_byte_helpers_equal_hand_literals(task):
  params = testing.example_params(jnp.float32)
  assert sync.onebit_adam_bytes(16, W, True) == ONEBIT_EXAMPLE
  assert sync.onebit_adam_bytes(1210, W, False) == ONEBIT_DIGITS["exact"]
  assert sync.onebit_adam_bytes(1210, W, True) == ONEBIT_DIGITS["onebit"]
  assert sync.demo_bytes(params, W, chunk=4, k=2) == DEMO_EXAMPLE
  # 128 x 64 at chunk 64, k 32: two 64 x 64 tiles, 32 (f32, u16) pairs each, 7 * 2 * 32 * 6.
  assert sync.demo_bytes({"w": jnp.zeros((128, 64))}, W) == 2688
  for collective, want in LQ_EXAMPLE.items():
    assert sync.lq_sgd_bytes(params, 1, W, bits=4, min_compression_rate=0,
                             collective=collective) == want
  assert _n(task[0]) == 1210


def test_onebit_adam_bytes_per_branch(mesh8, task):
  params = task[0]
  tx = sync.onebit_adam(0.01, freeze_step=1)
  trainer = train.Trainer(task[1], tx, mesh8)
  state = trainer.init(params)
  report = comm.inspect(trainer.step_fn(state, task[2][0]), state, task[2][0])
  exact, onebit = ONEBIT_DIGITS["exact"], ONEBIT_DIGITS["onebit"]
  assert report.wire_bytes(conditional=True) == exact + onebit, report.table()
  # Sign bits and f32 scales travel packed in one u8 buffer: one collective per phase.
  for op in ("all-to-all", "all-gather"):
    assert [c.dtype for c in report.select(op=op)] == ["u8"], report.table()
  counted = []
  for t in range(2):
    state, m = trainer.step(state, task[2][t])
    counted.append(int(m["wire_bytes"]))
  assert counted == [exact, onebit]


# ---------------------------------------------------------------------------- 1-bit Adam
def test_onebit_adam_before_freeze_equals_adam_on_exact_mean(mesh8, task):
  kw = dict(b1=0.9, b2=0.99, eps=1e-8)
  _, ref, _ = _run(mesh8, optax.chain(sync.mean(), optax.adam(0.01, **kw)), task, steps=3)
  trainer, state, _ = _run(mesh8, sync.onebit_adam(0.01, freeze_step=3, **kw), task, steps=3)
  np.testing.assert_allclose(_flat(state.params), _flat(ref.params), rtol=1e-4, atol=1e-6)
  s = state.opt_state
  layout = trainer.layout.opt_state
  assert layout.worker_error and layout.server_error and not layout.mu and not layout.nu
  assert np.abs(np.asarray(s.worker_error)).max() == 0  # nothing compressed yet


def _np_sign_roundtrip(chunks):
  """numpy reference of codecs.sign() on each row: sign (0 counts as +) times mean |x|."""
  scale = np.mean(np.abs(chunks), axis=-1, keepdims=True)
  return np.where(chunks >= 0, scale, -scale).astype(np.float32)


def test_onebit_adam_after_freeze_matches_numpy_two_phase_reference(mesh8, task):
  """Two steps past the freeze: momentum, both error memories, frozen variance and the
  parameter update against a numpy re-implementation of the compressed all-reduce."""
  _, loss, batches = task
  lr, b1, b2, eps, freeze = 0.01, 0.9, 0.999, 1e-8, 2
  trainer, state, _ = _run(mesh8, sync.onebit_adam(lr, freeze_step=freeze), task, steps=freeze)
  grads = jax.jit(jax.vmap(lambda p, b: codecs.flatten(jax.grad(loss)(p, b))[0],
                           in_axes=(None, 0)))
  s = state.opt_state
  nu = np.asarray(s.nu)
  mu = np.asarray(s.mu)
  n = mu.size
  c = -(-n // W)  # owner r reduces elements [r c, (r + 1) c) of the zero-padded vector
  worker_error = np.zeros((W, n), np.float32)
  server_error = np.zeros((W, W * c), np.float32)
  for t in (freeze, freeze + 1):
    params = jax.tree.map(np.asarray, state.params)  # the step consumes (donates) state
    split = jax.tree.map(lambda x: x.reshape(W, -1, *x.shape[1:]), batches[t])
    g = np.asarray(grads(params, split))  # [W, n] local gradients
    state, _ = trainer.step(state, batches[t])
    s = state.opt_state
    sent = b1 * mu + (1 - b1) * g + worker_error
    # Phase 1: every worker encodes its W chunks (padding included); owner r sums chunk r.
    own = _np_sign_roundtrip(np.pad(sent, ((0, 0), (0, W * c - n))).reshape(W, W, c))
    summed = own.sum(0) + server_error.reshape(W, W, c)[np.arange(W), np.arange(W)]
    # Phase 2: owner r re-encodes its sum, keeps the error, everyone decodes the W chunks.
    reduced = _np_sign_roundtrip(summed)
    worker_error = sent - own.reshape(W, W * c)[:, :n]
    for r in range(W):
      server_error[r, r * c:(r + 1) * c] = summed[r] - reduced[r]
    server_error[:, n:] = 0.0  # the state keeps n slots: the padding's error is dropped
    mu = reduced.reshape(-1)[:n] / W
    np.testing.assert_allclose(np.asarray(s.mu), mu, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(s.worker_error), worker_error, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s.server_error), server_error[:, :n], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(np.asarray(s.nu), nu)  # frozen
    # Adam's step with m's bias correction at t + 1 and v's frozen at the freeze step.
    m_hat, v_hat = mu / (1 - b1 ** (t + 1)), nu / (1 - b2 ** freeze)
    want = np.where(nu > 0, -lr * m_hat / (np.sqrt(v_hat) + eps), 0.0)
    np.testing.assert_allclose(_flat(state.params) - _flat(params), want, rtol=1e-4, atol=1e-7)
  assert np.abs(server_error).max() > 0 and np.abs(worker_error).max() > 0


# ---------------------------------------------------------------------------- DeMo
def test_demo_full_k_and_beta0_is_sign_sgd_on_exact_mean(mesh8, task):
  params, loss, batches = task
  lr = 0.01
  trainer, state, _ = _run(mesh8, sync.demo(lr, beta=0.0, chunk=16, k=256), task, steps=1)
  split = jax.tree.map(lambda x: x.reshape(W, -1, *x.shape[1:]), batches[0])
  g = np.asarray(jax.jit(jax.vmap(lambda b: codecs.flatten(jax.grad(loss)(params, b))[0]))(split))
  mean = g.mean(0)
  update = _flat(state.params) - _flat(params)
  # sign() of a coordinate whose mean is 0 up to float32 rounding is noise: compare the rest.
  clear = np.abs(mean) > 1e-5 * np.abs(mean).max()
  assert clear.mean() > 0.5  # a third are weights of always-blank pixels (gradient 0)
  np.testing.assert_allclose(update[clear], -lr * np.sign(mean[clear]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(state.opt_state.delta), 0.0, atol=1e-6)  # all sent
  assert trainer.layout.opt_state.delta


def test_demo_momentum_keeps_what_was_not_sent(mesh8, task):
  params, loss, batches = task
  trainer, state, _ = _run(mesh8, sync.demo(0.01, beta=0.5, chunk=16, k=2, weight_decay=0.1),
                           task, steps=1)
  split = jax.tree.map(lambda x: x.reshape(W, -1, *x.shape[1:]), batches[0])
  g = np.asarray(jax.jit(jax.vmap(lambda b: codecs.flatten(jax.grad(loss)(params, b))[0]))(split))
  codec = codecs.tiled_dct_top_k([x.shape for x in jax.tree.leaves(params)], 16, 2)
  roundtrip = jax.jit(codec.roundtrip)  # one program for the 8 rows, not an eager op each
  sent = np.stack([np.asarray(roundtrip(jnp.asarray(0.01 * x))) for x in g])
  np.testing.assert_allclose(np.asarray(state.opt_state.delta), 0.01 * g - sent, atol=1e-7)
  want = -0.01 * np.sign(sent.mean(0)) - 0.01 * 0.1 * _flat(params)
  np.testing.assert_allclose(_flat(state.params) - _flat(params), want, atol=1e-6)


# ---------------------------------------------------------------------------- LQ-SGD
def _np_log_quant(rows, bits=4, alpha=10.0):
  """numpy reference of codecs.log_quant(bits, alpha) with one scale per row, in float32."""
  rows = np.asarray(rows, np.float32)
  levels = 2 ** (bits - 1) - 1
  m = np.max(np.abs(rows), axis=-1, keepdims=True)
  q = np.log1p(np.float32(alpha) * np.abs(rows) / np.where(m > 0, m, 1)) / np.float32(
      np.log1p(alpha))
  lv = np.clip(np.round(q * levels), 0, levels)
  mag = np.expm1(lv / levels * np.float32(np.log1p(alpha))) / np.float32(alpha)
  return (np.where(rows < 0, -mag, mag) * m).astype(np.float32)


def _np_factor_sum(flat, collective):
  """What every worker ends with for sum_w of a factor [W, k], and what each one sent."""
  if collective == "gather":
    own = _np_log_quant(flat)
    return own.sum(0), own
  k = flat.shape[1]
  c = -(-k // W)
  own = _np_log_quant(np.pad(flat, ((0, 0), (0, W * c - k))).reshape(W * W, c)).reshape(W, W, c)
  reduced = _np_log_quant(own.sum(0))  # owner r re-encodes its chunk's sum
  return reduced.reshape(-1)[:k], own.reshape(W, W * c)[:, :k]


@pytest.mark.parametrize("collective", ["gather", "two_phase"])
def test_lq_sgd_matches_numpy_reference(mesh8, task, collective):
  """One step of rank-2, 4-bit LQ-SGD on the digits MLP against numpy: the update and every
  worker's error memory (coarse levels: float noise does not move a value across a level)."""
  params = task[0]
  tx = optax.chain(sync.lq_sgd(2, bits=4, min_compression_rate=0, collective=collective),
                   optax.sgd(1.0))
  trainer, state, _ = _run(mesh8, tx, task, steps=1)
  split = jax.tree.map(lambda x: x.reshape(W, -1, *x.shape[1:]), task[2][0])
  local = jax.jit(jax.vmap(jax.grad(task[1]), in_axes=(None, 0)))(params, split)
  leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(local)]  # [W, ...] each
  q0 = [np.asarray(q[0]) for q in tx.init(params)[0].q]
  # Kernels (64 x 16 and 16 x 10) oriented shorter side first; biases averaged exactly.
  kernels = [i for i, x in enumerate(leaves) if x.ndim == 3]
  mats = [np.swapaxes(leaves[i], 1, 2) for i in kernels]
  p_sum, _ = _np_factor_sum(np.concatenate([
      np.stack([m[w] @ q for w in range(W)]).reshape(W, -1) for m, q in zip(mats, q0)], 1),
      collective)
  p_hats, offset = [], 0
  for m, q in zip(mats, q0):
    size = m.shape[1] * q.shape[1]
    p_hats.append(_gram_schmidt(p_sum[offset:offset + size].reshape(m.shape[1], q.shape[1])))
    offset += size
  q_sum, q_sent = _np_factor_sum(np.concatenate([
      np.stack([m[w].T @ ph for w in range(W)]).reshape(W, -1) for m, ph in zip(mats, p_hats)],
      1), collective)
  want, errors, offset = [x.mean(0) for x in leaves], [], 0
  for i, m, ph in zip(kernels, mats, p_hats):
    shape = (m.shape[2], ph.shape[1])
    size = shape[0] * shape[1]
    want[i] = (ph @ (q_sum[offset:offset + size].reshape(shape) / W).T).T
    errors.append(np.stack([m[w] - ph @ q_sent[w, offset:offset + size].reshape(shape).T
                            for w in range(W)]))
    offset += size
  want = np.concatenate([x.ravel() for x in want])
  np.testing.assert_allclose(_flat(params) - _flat(state.params), want,
                             atol=1e-5 * np.abs(want).max())
  for e, ref in zip(state.opt_state[0].error, errors):
    np.testing.assert_allclose(np.asarray(e)[:, 0], ref, atol=1e-5 * np.abs(ref).max())
  assert trainer.layout.opt_state[0].error  # per worker


# ---------------------------------------------------------------------------- bad input
def test_bad_input_fails_when_built():
  for make, word in [
      (lambda: sync.lq_sgd(0), "rank"), (lambda: sync.lq_sgd(2, bits=1), "bits"),
      (lambda: sync.lq_sgd(2, bits=17), "bits"),
      (lambda: sync.lq_sgd(2, collective="psum"), "collective"),
      (lambda: sync.onebit_adam(0.1, freeze_step=-1), "freeze_step"),
      (lambda: sync.onebit_adam(0.1, freeze_step=1, b1=1.0), "b1"),
      (lambda: sync.demo(0.1, chunk=0), "chunk"), (lambda: sync.demo(0.1, chunk=8, k=65), "k"),
      (lambda: sync.demo(0.1, beta=1.0), "beta")]:
    with pytest.raises(ValueError, match=word):
      make()
