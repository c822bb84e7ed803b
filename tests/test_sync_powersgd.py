"""sync.powersgd: exactness at full rank, rank-r recovery, error memory, start_iter, bytes,
convergence with and without error feedback on digits, bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm import comm, data, models, sync, testing, train
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


# testing.example_params: w f32[3, 4] (n = 3 rows <= m = 4 columns, so not transposed) and
# b f32[4], averaged exactly. Rank 1: P is 3 x 1, Q is 4 x 1. All-reduce of P with b,
# (3 + 4) x 4 = 28 bytes: 2 * 7/8 * 28 = 49; all-reduce of Q, 16 bytes: 2 * 7/8 * 16 = 28.
EXAMPLE_RANK1 = 49 + 28
# The same step before start_iter: the exact mean, an all-reduce of 16 f32 = 64 bytes.
EXAMPLE_EXACT = 2 * 7 / 8 * 64  # 112
# digits MLP (64 -> 16 -> 10), rank 1, min_compression_rate 2: kernel 64 x 16 is turned to
# 16 x 64 (P 16, Q 64), kernel 16 x 10 to 10 x 16 (P 10, Q 16); both pass the rate test
# ((16 + 64) x 2 < 1024, (10 + 16) x 2 < 160); the biases (16 + 10) travel with P.
# P all-reduce: (16 + 10 + 26) x 4 = 208 bytes -> 364; Q: (64 + 16) x 4 = 320 -> 560.
DIGITS_RANK1 = 364 + 560


def test_bytes_counted_equal_inspect_and_formula(mesh8):
  tx = optax.chain(sync.powersgd(1, min_compression_rate=0), optax.sgd(0.1))
  _, _, m, report = testing.check_on_mesh(tx, mesh8, steps=2)  # asserts counted == inspect
  assert int(m["wire_bytes"]) == EXAMPLE_RANK1
  assert len(report.collectives) == 2  # one all-reduce for P (+ exact leaves), one for Q


def test_powersgd_bytes_helper_equals_hand_literals(task):
  params = testing.example_params(jnp.float32)
  assert sync.powersgd_bytes(params, 1, W, min_compression_rate=0) == EXAMPLE_RANK1
  assert sync.powersgd_bytes(task[0], 1, W) == DIGITS_RANK1
  # Rate 2 on the example: (3 + 4) x 1 x 2 = 14 >= 12, so w is averaged exactly too.
  assert sync.powersgd_bytes(params, 1, W) == EXAMPLE_EXACT
  assert sync.powersgd_bytes(params, 1, 1) == 0.0


def test_start_iter_bytes_counted_per_branch_equal_inspect_and_formula(mesh8):
  params = testing.example_params(jnp.float32)
  loss = lambda p, b: 0.5 * sum(jnp.sum((x - b["t"][0, i]) ** 2)
                                for i, x in enumerate(jax.tree.leaves(p)))
  batch = {"t": jnp.arange(W * 2, dtype=jnp.float32).reshape(W, 2) / W}
  tx = optax.chain(sync.powersgd(1, min_compression_rate=0, start_iter=1), optax.sgd(0.1))
  trainer = train.Trainer(loss, tx, mesh8)
  state = trainer.init(params)
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  assert report.wire_bytes(conditional=True) == EXAMPLE_EXACT + EXAMPLE_RANK1, report.table()
  counted = []
  for _ in range(2):
    state, m = trainer.step(state, batch)
    counted.append(int(m["wire_bytes"]))
  assert counted == [EXAMPLE_EXACT, EXAMPLE_RANK1]


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


def test_error_memory_and_update_equal_numpy_power_iteration(mesh8, task):
  params = task[0]
  tx = optax.chain(sync.powersgd(2, min_compression_rate=0), optax.sgd(1.0))
  trainer, state, _ = _run(mesh8, tx, task, steps=1)
  q0 = iter(tx.init(params)[0].q)
  errors = iter(state.opt_state[0].error)
  assert len(state.opt_state[0].error) == 2
  # The update of SGD(1) is minus PowerSGD's output, leaf by leaf (flattened in leaf order).
  want = []
  for leaf in jax.tree.leaves(_local_grads(task)):  # [W, ...] local gradients
    gw = np.asarray(leaf, np.float64)
    if gw.ndim == 2:  # a bias: the exact mean
      want.append(gw.mean(0))
      continue
    transposed = gw.shape[1] > gw.shape[2]  # oriented with the shorter side first
    if transposed:
      gw = np.swapaxes(gw, 1, 2)
    q = np.asarray(next(q0)[0])  # the shared initial Q of this matrix
    p_hat = _gram_schmidt(sum(gw[w] @ q for w in range(W)))
    local = np.stack([p_hat @ (p_hat.T @ gw[w]) for w in range(W)])  # P^ Q_w^T
    e = np.asarray(next(errors))[:, 0]
    np.testing.assert_allclose(e, gw - local, atol=2e-5)
    assert np.abs(e).max() > 1e-3  # rank 2 really drops something
    mean = local.mean(0)  # P^ Q^T with Q = mean_w Q_w
    want.append(mean.T if transposed else mean)
  update = _flat(state.params) - _flat(params)
  want = np.concatenate([np.ravel(x) for x in want])
  np.testing.assert_allclose(update, -want, atol=1e-5 * np.abs(want).max())


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
  assert runs["psgd"][2][1] == DIGITS_RANK1


# ---------------------------------------------------------------------------- convergence
@pytest.mark.slow
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
  # 64 x 576, so rank 4 sends P (64 x 4) and Q (576 x 4) instead of capping the rank at 3:
  # 2 * 7/8 * 4 * 256 = 1792 and 2 * 7/8 * 4 * 2304 = 16128.
  params = {"k": jnp.zeros((3, 3, 64, 64))}
  assert sync.powersgd_bytes(params, 4, W) == 1792 + 16128
  state = sync.powersgd(4).init(params)
  assert state.q[0].shape == (1, 576, 4) and state.error[0].shape == (1, 64, 576)


def test_densegeneral_kernel_is_viewed_inputs_by_outputs_and_views_override():
  # The LM's fused attention kernel (DenseGeneral, 768 inputs -> 3 x 12 x 64 outputs) is the
  # 768 x 2304 matrix: rank 4 sends P (768 x 4) and Q (2304 x 4) float32, 4 x (768 + 2304)
  # x 4 = 49,152 bytes of payload. The repo counts a ring all-reduce as 2 (W - 1) / W of the
  # payload per device, which is exactly 1 at W = 2: 49,152 bytes per device per step. (The
  # old prod(shape[:-1]) x shape[-1] view, 27648 x 64, sends 4 x (27648 + 64) x 4 = 443,392.)
  kernel = {"qkv": jax.ShapeDtypeStruct((768, 3, 12, 64), jnp.float32)}
  assert sync.powersgd_bytes(kernel, 4, 2) == 4 * (768 + 2304) * 4 == 49_152
  assert sync.powersgd_bytes(kernel, 4, 2, views={"qkv": 3}) == 443_392
  # A 3x3 conv kernel stays (3 x 3 x 64) x 64 under the rule (tested above); the out
  # projection (12, 64, 768) is 768 x 768: 4 x 1536 x 4 = 24,576 at W = 2.
  proj = {"proj": jax.ShapeDtypeStruct((12, 64, 768), jnp.float32)}
  assert sync.powersgd_bytes(proj, 4, 2) == 24_576
  with pytest.raises(ValueError, match="views"):
    sync.powersgd(4, views={"qkv": 0})
  with pytest.raises(ValueError, match="views"):
    sync.powersgd_bytes(kernel, 4, 2, views={"qkv": 4})


def test_view_bytes_counted_equal_inspect_and_update_is_the_view_reconstruction():
  # Counted == compiled on a 2-worker mesh for a (16, 3, 2, 4) kernel viewed 16 x 24 at rank
  # 2: P 16 x 2 and Q 24 x 2 float32, (32 + 48) x 4 = 320 bytes (factor 1 at W = 2). The
  # update, with both workers' gradients equal to one rank-2 matrix of that view, is it.
  mesh = train.make_mesh({"data": 2}, devices=jax.devices()[:2])
  rng = np.random.default_rng(0)
  target = (rng.normal(size=(16, 2)) @ rng.normal(size=(2, 24))).astype(np.float32)
  params = {"k": jnp.zeros((16, 3, 2, 4))}
  loss = lambda p, b: -jnp.sum(p["k"].reshape(16, 24) * b["t"][0])
  batch = {"t": jnp.broadcast_to(jnp.asarray(target), (2, 16, 24))}
  trainer = train.Trainer(loss, optax.chain(sync.powersgd(2), optax.sgd(1.0)), mesh)
  state = trainer.init(params)
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  state, m = trainer.step(state, batch)
  assert int(m["wire_bytes"]) == report.wire_bytes() == (32 + 48) * 4
  np.testing.assert_allclose(np.asarray(state.params["k"]).reshape(16, 24), target,
                             rtol=1e-4, atol=1e-4)
