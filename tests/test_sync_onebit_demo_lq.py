"""sync.onebit_adam, sync.demo, sync.lq_sgd: exactness against references, bytes, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm import codecs, comm, data, models, sync, testing, train
from tests import contract

W = 8


@pytest.fixture(scope="module")
def task():
  return contract.digits_task(4)


_run = contract.run_steps
_flat = contract.flat


def _n(params):
  return sum(x.size for x in jax.tree.leaves(params))


# ---------------------------------------------------------------------------- contract suite
@pytest.mark.parametrize("name", ["onebit_adam", "demo", "lq_sgd"])
def test_contract(name):
  tx = {"onebit_adam": lambda: sync.onebit_adam(0.05, freeze_step=20, axis_name=None),
        "demo": lambda: sync.demo(0.02, beta=0.9, chunk=8, k=4, axis_name=None),
        "lq_sgd": lambda: optax.chain(sync.lq_sgd(1, bits=6, min_compression_rate=0,
                                                  axis_name=None), optax.sgd(0.2))}[name]()
  testing.check_transform(tx, steps=300)


# ---------------------------------------------------------------------------- bytes
def test_bytes_counted_equal_inspect_and_formula(mesh8):
  params = testing.example_params(jnp.float32)
  n = _n(params)
  cases = [
      (sync.onebit_adam(0.01, freeze_step=0), sync.onebit_adam_bytes(n, W, True)),
      (sync.demo(0.01, chunk=4, k=2), sync.demo_bytes(params, W, chunk=4, k=2)),
      (optax.chain(sync.lq_sgd(1, bits=4, min_compression_rate=0), optax.sgd(0.1)),
       sync.lq_sgd_bytes(params, 1, W, bits=4, min_compression_rate=0)),
      (optax.chain(sync.lq_sgd(1, bits=4, min_compression_rate=0, collective="gather"),
                   optax.sgd(0.1)),
       sync.lq_sgd_bytes(params, 1, W, bits=4, min_compression_rate=0, collective="gather")),
  ]
  for tx, want in cases:
    _, _, m, _ = testing.check_on_mesh(tx, mesh8)  # asserts counted == comm.inspect
    assert int(m["wire_bytes"]) == round(want)


def test_onebit_adam_bytes_per_branch(mesh8, task):
  params = task[0]
  n = _n(params)
  tx = sync.onebit_adam(0.01, freeze_step=1)
  trainer = train.Trainer(task[1], tx, mesh8)
  state = trainer.init(params)
  report = comm.inspect(trainer.step_fn(state, task[2][0]), state, task[2][0])
  exact, onebit = sync.onebit_adam_bytes(n, W, False), sync.onebit_adam_bytes(n, W, True)
  assert round(report.wire_bytes(conditional=True)) == round(exact + onebit), report.table()
  # Sign bits and f32 scales travel packed in one u8 buffer: one collective per phase.
  for op in ("all-to-all", "all-gather"):
    assert [c.dtype for c in report.select(op=op)] == ["u8"], report.table()
  counted = []
  for t in range(2):
    state, m = trainer.step(state, task[2][t])
    counted.append(int(m["wire_bytes"]))
  assert counted == [round(exact), round(onebit)]
  assert onebit < exact / 10  # 1 bit + a scale per chunk vs 32 bits


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


def test_onebit_adam_after_freeze_variance_frozen_and_memories_exact(mesh8, task):
  _, loss, batches = task
  trainer, state, _ = _run(mesh8, sync.onebit_adam(0.01, freeze_step=2), task, steps=2)
  nu_frozen = np.asarray(state.opt_state.nu)
  mu_before = np.asarray(state.opt_state.mu)
  params_before = jax.tree.map(np.asarray, state.params)  # the step consumes state
  state, _ = trainer.step(state, batches[2])
  s = state.opt_state
  np.testing.assert_array_equal(np.asarray(s.nu), nu_frozen)
  # Worker w sent C(b1 mu + (1 - b1) g_w); its memory is what that lost (e_w was 0).
  split = jax.tree.map(lambda x: x.reshape(W, -1, *x.shape[1:]), batches[2])
  g = np.asarray(jax.jit(jax.vmap(lambda b: codecs.flatten(jax.grad(loss)(params_before, b))[0]))(split))
  sent = 0.9 * mu_before + 0.1 * g
  codec = codecs.sign()
  n = sent.shape[1]
  c = -(-n // W)
  chunks = np.pad(sent, ((0, 0), (0, W * c - n))).reshape(W, W, c)
  own = np.stack([np.concatenate([np.asarray(codec.roundtrip(jnp.asarray(ch))) for ch in wk])[:n]
                  for wk in chunks])
  np.testing.assert_allclose(np.asarray(s.worker_error), sent - own, atol=1e-5)
  # The new momentum is (close to) the mean of what was sent: two 1-bit rounds lose a lot,
  # but it points the same way.
  cos = np.dot(np.asarray(s.mu), sent.mean(0)) / (np.linalg.norm(s.mu) * np.linalg.norm(sent.mean(0)))
  assert cos > 0.5, cos


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
  sent = np.stack([np.asarray(codec.roundtrip(jnp.asarray(0.01 * x))) for x in g])
  np.testing.assert_allclose(np.asarray(state.opt_state.delta), 0.01 * g - sent, atol=1e-7)
  want = -0.01 * np.sign(sent.mean(0)) - 0.01 * 0.1 * _flat(params)
  np.testing.assert_allclose(_flat(state.params) - _flat(params), want, atol=1e-6)


# ---------------------------------------------------------------------------- LQ-SGD
@pytest.mark.parametrize("collective", ["two_phase"])  # gather: see the bytes test
def test_lq_sgd_16_bits_full_rank_is_close_to_exact_mean(mesh8, task, collective):
  _, ref, _ = _run(mesh8, optax.chain(sync.mean(), optax.sgd(1.0)), task, steps=1)
  tx = optax.chain(sync.lq_sgd(64, bits=16, alpha=1.0, min_compression_rate=0,
                               collective=collective), optax.sgd(1.0))
  trainer, state, _ = _run(mesh8, tx, task, steps=1)
  want = _flat(ref.params) - _flat(task[0])
  got = _flat(state.params) - _flat(task[0])
  assert np.linalg.norm(got - want) < 1e-2 * np.linalg.norm(want)
  assert trainer.layout.opt_state[0].error


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
