"""sync.powersgd: exactness at full rank, rank-r recovery, error memory, start_iter, bytes,
convergence with and without error feedback on digits, bad input."""

import chex
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
  return contract.digits_task(3)


_run = contract.run_steps
_flat = contract.flat


def _local_grads(task, t=0):
  """Worker w's local gradient tree of step t at the initial parameters, stacked [W, ...]."""
  params, loss, batches = task
  split = jax.tree.map(lambda x: x.reshape(W, -1, *x.shape[1:]), batches[t])
  return jax.jit(jax.vmap(lambda b: jax.grad(loss)(params, b)))(split)


# ---------------------------------------------------------------------------- contract suite
@pytest.mark.parametrize("warm_start", [True, False])
def test_contract(warm_start):
  tx = optax.chain(sync.powersgd(1, warm_start=warm_start, min_compression_rate=0,
                                 axis_name=None), optax.sgd(0.2))
  testing.check_transform(tx, steps=300)


def test_bytes_counted_equal_inspect_and_formula(mesh8):
  tx = optax.chain(sync.powersgd(1, min_compression_rate=0), optax.sgd(0.1))
  _, _, m, report = testing.check_on_mesh(tx, mesh8, steps=2)  # asserts counted == inspect
  params = testing.example_params(jnp.float32)
  assert int(m["wire_bytes"]) == round(sync.powersgd_bytes(params, 1, W, min_compression_rate=0))
  assert len(report.collectives) == 2  # one all-reduce for P (+ exact leaves), one for Q


def test_start_iter_bytes_counted_per_branch_equal_inspect_and_formula(mesh8):
  params = testing.example_params(jnp.float32)
  loss = lambda p, b: 0.5 * sum(jnp.sum((x - b["t"][0, i]) ** 2)
                                for i, x in enumerate(jax.tree.leaves(p)))
  batch = {"t": jnp.arange(W * 2, dtype=jnp.float32).reshape(W, 2) / W}
  tx = optax.chain(sync.powersgd(1, min_compression_rate=0, start_iter=1), optax.sgd(0.1))
  trainer = train.Trainer(loss, tx, mesh8)
  state = trainer.init(params)
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  exact = comm.allreduce_bytes(comm.tree_bytes(params), W)
  compressed = sync.powersgd_bytes(params, 1, W, min_compression_rate=0)
  assert round(report.wire_bytes(conditional=True)) == round(exact + compressed), report.table()
  counted = []
  for _ in range(2):
    state, m = trainer.step(state, batch)
    counted.append(int(m["wire_bytes"]))
  assert counted == [round(exact), round(compressed)]


# ---------------------------------------------------------------------------- exactness
def test_full_rank_equals_exact_mean(mesh8, task):
  _, ref, _ = _run(mesh8, optax.chain(sync.mean(), optax.sgd(1.0)), task, steps=2)
  for batch_same_shape in (True, False):
    tx = optax.chain(sync.powersgd(64, min_compression_rate=0,
                                   batch_same_shape=batch_same_shape), optax.sgd(1.0))
    trainer, state, _ = _run(mesh8, tx, task, steps=2)
    assert trainer.layout.opt_state[0].error  # error memories are per worker
    np.testing.assert_allclose(_flat(state.params), _flat(ref.params), atol=2e-5)


def test_rank_r_gradient_is_reconstructed(mesh8):
  rng = np.random.default_rng(0)
  g = (rng.normal(size=(24, 2)) @ rng.normal(size=(2, 40))).astype(np.float32)  # rank 2
  params = {"w": jnp.zeros((24, 40)), "b": jnp.zeros(40)}
  loss = lambda p, b: jnp.sum(p["w"] * g) + jnp.sum(p["b"]) + 0.0 * jnp.sum(b["x"])
  trainer = train.Trainer(loss, optax.chain(sync.powersgd(2), optax.sgd(1.0)), mesh8)
  state = trainer.init(params)
  batch = {"x": jnp.zeros((W, 1))}
  for _ in range(3):
    before = np.asarray(state.params["w"])
    state, _ = trainer.step(state, batch)
  np.testing.assert_allclose(before - np.asarray(state.params["w"]), g, atol=1e-4 * np.abs(g).max())
  np.testing.assert_allclose(np.asarray(state.opt_state[0].error[0]), 0.0, atol=1e-4)


def _gram_schmidt(p):
  q, r = np.linalg.qr(p)
  return q * np.sign(np.diag(r))


def test_error_memory_is_m_minus_local_reconstruction(mesh8, task):
  params = task[0]
  tx = optax.chain(sync.powersgd(2, min_compression_rate=0), optax.sgd(1.0))
  trainer, state, _ = _run(mesh8, tx, task, steps=1)
  q0 = tx.init(params)[0].q
  grads = _local_grads(task)
  kernels = [k for k in jax.tree.leaves(grads) if k.ndim == 3]  # [W, rows, cols]
  errors = state.opt_state[0].error
  assert len(errors) == len(kernels) == 2
  update = _flat(state.params) - _flat(params)
  recon_mean = []
  for gw, q, e in zip(kernels, q0, errors):
    gw = np.asarray(gw, np.float64)
    if gw.shape[1] > gw.shape[2]:  # oriented with the shorter side first
      gw = np.swapaxes(gw, 1, 2)
    p_hat = _gram_schmidt(sum(gw[w] @ np.asarray(q[0]) for w in range(W)))
    local = np.stack([p_hat @ (p_hat.T @ gw[w]) for w in range(W)])
    np.testing.assert_allclose(np.asarray(e)[:, 0], gw - local, atol=2e-5)
    recon_mean.append(local.mean(0))
  assert np.abs(np.asarray(errors[0])).max() > 1e-3  # rank 2 really drops something
  # The update is the mean of the local reconstructions (P^ Q^T with Q = mean Q_w).
  assert np.isclose(np.linalg.norm(update), np.sqrt(
      sum(np.sum(r ** 2) for r in recon_mean) +
      sum(np.sum(np.asarray(b).mean(0) ** 2) for b in jax.tree.leaves(grads) if b.ndim == 2)),
      rtol=1e-4)


def test_start_iter_first_steps_are_exact_dp(mesh8, task):
  runs = {}
  for name, s in [("dp", sync.mean()), ("psgd", sync.powersgd(1, start_iter=2))]:
    trainer = train.Trainer(task[1], optax.chain(s, optax.sgd(0.5)), mesh8)
    state = trainer.init(task[0])
    runs[name] = []
    for t in range(3):
      state, m = trainer.step(state, task[2][t])
      runs[name].append((_flat(state.params), int(m["wire_bytes"])))
  for t in range(2):  # exact DP, bytes included
    np.testing.assert_allclose(runs["psgd"][t][0], runs["dp"][t][0], atol=1e-6)
    assert runs["psgd"][t][1] == runs["dp"][t][1]
  assert np.abs(runs["psgd"][2][0] - runs["dp"][2][0]).max() > 1e-4  # then it compresses
  assert runs["psgd"][2][1] == round(sync.powersgd_bytes(task[0], 1, W))


# ---------------------------------------------------------------------------- convergence
def test_rank2_with_ef_matches_dp_and_beats_no_ef_on_digits(mesh8):
  ds = data.digits()
  model = models.MLP(hidden=(16,), num_classes=10)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 64)))
  loss = models.classifier_loss(model)
  x, y = jnp.asarray(ds.x), jnp.asarray(ds.y)
  acc = lambda p: models.accuracy(model, p, x, y)
  results = {}
  for name, s in [("dp", sync.mean()), ("ef", sync.powersgd(2)),
                  ("no_ef", sync.powersgd(2, memory=None))]:
    trainer = train.Trainer(loss, optax.chain(s, optax.sgd(0.1, momentum=0.9)), mesh8,
                            has_aux=True)
    state = trainer.init(params)
    for t in range(STEPS):
      state, _ = trainer.step(state, ds.batch(t, 128))
    results[name] = acc(state.params)
  assert results["dp"] > 0.9, results
  assert results["ef"] >= results["dp"] - 0.01, results
  assert results["no_ef"] < results["ef"] - 0.02, results


STEPS = 300  # measured: dp 0.979, rank 2 + EF 0.978, rank 2 without EF 0.946


# ---------------------------------------------------------------------------- bad input
def test_bad_input_fails_when_built():
  for make, word in [(lambda: sync.powersgd(0), "rank"), (lambda: sync.powersgd(1.5), "rank"),
                     (lambda: sync.powersgd(2, start_iter=-1), "start_iter"),
                     (lambda: sync.powersgd(2, min_compression_rate=-1), "min_compression_rate"),
                     (lambda: sync.powersgd(2, orthogonalization_epsilon=-1.0),
                      "orthogonalization_epsilon"),
                     (lambda: sync.powersgd(2, memory="ef21"), "memory"),
                     (lambda: sync.lq_sgd(2, memory=True), "memory"),
                     (lambda: sync.powersgd(2, key=0), "key"),
                     (lambda: sync.lq_sgd(2, key=jax.random.key(0, impl="rbg")), "key")]:
    with pytest.raises(ValueError, match=word):
      make()


def test_key_none_is_the_fixed_default_key_0():
  params = {"w": jnp.zeros((8, 4))}
  first_q = lambda **kw: sync.powersgd(2, min_compression_rate=0, **kw).init(params).q[0]
  chex.assert_trees_all_equal(first_q(), first_q(key=jax.random.key(0)))
  chex.assert_trees_all_equal(first_q(), first_q(key=jax.random.PRNGKey(0)))  # raw key data
  assert not jnp.allclose(first_q(), first_q(key=jax.random.key(1)))


def test_conv_kernels_are_viewed_with_output_features_last():
  # Flax conv kernels are kh x kw x C_in x C_out: the matrix is (kh kw C_in) x C_out, oriented
  # 64 x 576, so rank 4 sends P (64 x 4) and Q (576 x 4) instead of capping the rank at 3.
  params = {"k": jnp.zeros((3, 3, 64, 64))}
  assert sync.powersgd_bytes(params, 4, W) == comm.allreduce_bytes(4 * (64 * 4 + 576 * 4), W)
  state = sync.powersgd(4).init(params)
  assert state.q[0].shape == (1, 576, 4) and state.error[0].shape == (1, 64, 576)
