"""sync.compressed: exactness against sync.mean, memories, hierarchy, convergence, bytes, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm import codecs, comm, data, models, sync, train
from tests import contract

W = 8
ZOO = contract.codec_zoo()
KEY = jax.random.key(0)


# ---------------------------------------------------------------------------- contract suite
@pytest.mark.parametrize("name", list(ZOO))
def test_contract_every_codec_with_error_feedback(name):
  # EF is stable for lr below about the codec's contraction (top-1 of 16 here): small lr.
  codec = ZOO[name]
  tx = optax.chain(sync.compressed(codec, memory="ef", axis_name=None, key=KEY), optax.sgd(0.02))
  contract.check_transform(tx, steps=300)


@pytest.mark.parametrize("memory", [None, "ef21", "loco"])
def test_contract_memories(memory):
  codec = codecs.top_k(0.25) if memory else codecs.qsgd(15, bucket=None)
  tx = optax.chain(sync.compressed(codec, memory=memory, axis_name=None, key=KEY),
                   optax.sgd(0.05 if memory else 0.3))
  contract.check_transform(tx, steps=300)


# ---------------------------------------------------------------------------- digits task
@pytest.fixture(scope="module")
def task():
  model = models.MLP(hidden=(16,), num_classes=10)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  ds = data.digits()
  return params, loss, [ds.batch(t, 64) for t in range(3)]


def _run(mesh, tx, task, steps=2, axis_name="data"):
  params, loss, batches = task
  trainer = train.Trainer(loss, tx, mesh, axis_name=axis_name)
  state = trainer.init(params)
  for t in range(steps):
    state, m = trainer.step(state, batches[t])
  return trainer, state, m


def _local_grads(task, t=0):
  """[W, n] local gradients of step t at the initial parameters (worker w: w-th slice)."""
  params, loss, batches = task
  split = jax.tree.map(lambda x: x.reshape(W, -1, *x.shape[1:]), batches[t])
  grad_w = lambda b: codecs.flatten(jax.grad(loss)(params, b))[0]
  return np.asarray(jax.jit(jax.vmap(grad_w))(split))


def _flat(tree):
  return np.asarray(codecs.flatten(tree)[0])


def test_identity_and_cast_float32_equal_sync_mean(mesh8, task):
  _, ref, _ = _run(mesh8, optax.chain(sync.mean("data"), optax.adam(1e-2)), task)
  for codec, collective in [(codecs.identity(), None), (codecs.identity(), "gather"),
                            (codecs.cast("float32"), "two_phase")]:
    tx = optax.chain(sync.compressed(codec, collective=collective), optax.adam(1e-2))
    _, state, _ = _run(mesh8, tx, task)
    np.testing.assert_allclose(_flat(state.params), _flat(ref.params), rtol=1e-5, atol=1e-6)


def test_random_k_shared_key_psum_equals_mean_of_masked_gradients(mesh8, task):
  params = task[0]
  codec = codecs.random_k(0.1)
  tx = optax.chain(sync.compressed(codec, key=KEY), optax.sgd(1.0))
  assert tx.init(params)[0].memory is None
  _, state, _ = _run(mesh8, tx, task, steps=1)
  update = _flat(state.params) - _flat(params)
  # The coordinates every worker drew: the transform splits its key once per update.
  _, sub = jax.random.split(KEY)
  mask = np.asarray(jax.jit(codec.roundtrip)(jnp.ones(update.size), sub)) != 0
  assert mask.sum() == round(0.1 * update.size)
  np.testing.assert_allclose(update, -np.where(mask, _local_grads(task), 0.0).mean(0),
                             rtol=1e-5, atol=1e-7)
  assert np.count_nonzero(update) > 0.5 * mask.sum()


@pytest.mark.parametrize("memory", ["ef", "loco"])
def test_memory_after_a_step_is_input_minus_decoded(mesh8, task, memory):
  codec = codecs.top_k(k=8, chunk=64)
  tx = optax.chain(sync.compressed(codec, memory=memory, beta=0.5), optax.sgd(1.0))
  trainer, state, _ = _run(mesh8, tx, task, steps=1)
  g = _local_grads(task)
  decoded = np.stack([np.asarray(jax.jit(codec.roundtrip)(jnp.asarray(x))) for x in g])
  mem = np.asarray(state.opt_state[0].memory, np.float32)
  assert mem.shape == g.shape and trainer.layout.opt_state[0].memory
  want = g - decoded if memory == "ef" else 0.5 * (g - decoded)
  tol = 1e-6 if memory == "ef" else 1e-2 * np.abs(want).max()  # loco keeps bf16
  np.testing.assert_allclose(mem, want, atol=tol)
  np.testing.assert_allclose(_flat(state.params) - _flat(task[0]), -decoded.mean(0), atol=1e-6)


def test_ef21_aggregate_is_the_mean_of_worker_states(mesh8, task):
  tx = optax.chain(sync.compressed(codecs.top_k(0.1), memory="ef21"), optax.sgd(0.1))
  trainer, state, _ = _run(mesh8, tx, task, steps=3)
  s = state.opt_state[0]
  assert not trainer.layout.opt_state[0].aggregate and trainer.layout.opt_state[0].memory
  np.testing.assert_allclose(s.aggregate, np.asarray(s.memory).mean(0), atol=1e-6)
  assert np.abs(s.aggregate).max() > 0


def test_per_worker_keys_unless_shared(mesh8):
  """Identical gradients everywhere: stochastic rounding differs per worker, random-k does not."""
  params = {"w": jnp.linspace(-1.0, 1.0, 64)}
  loss = lambda p, b: 0.5 * jnp.sum((p["w"] - 2.0) ** 2) + 0.0 * jnp.sum(b["x"])
  batch = {"x": jnp.zeros((W, 1))}
  for codec, distinct in [(codecs.uniform(2, stochastic=True), True), (codecs.random_k(0.5), False)]:
    tx = optax.chain(sync.compressed(codec, memory="ef", collective="gather", key=KEY),
                     optax.sgd(0.1))
    trainer = train.Trainer(loss, tx, mesh8)
    state = trainer.init(params)
    key0 = state.opt_state[0].key
    state, _ = trainer.step(state, batch)
    assert not np.array_equal(state.opt_state[0].key, key0)  # split every update
    mem = np.asarray(state.opt_state[0].memory)
    assert (len({m.tobytes() for m in mem}) == W) == distinct, codec.name


# ---------------------------------------------------------------------------- hierarchical
def test_hierarchical_fast_axis_exact_slow_axis_compressed(mesh4x2, task):
  axes = ("tensor", "data")  # first axis fast (exact), the rest slow (compressed)
  n = _flat(task[0]).size
  _, ref, _ = _run(mesh4x2, optax.chain(sync.mean(axes), optax.adam(1e-2)), task, axis_name=axes)
  _, state, _ = _run(mesh4x2, optax.chain(sync.compressed(codecs.identity(), axis_name=axes),
                                          optax.adam(1e-2)), task, axis_name=axes)
  np.testing.assert_allclose(_flat(state.params), _flat(ref.params), rtol=1e-5, atol=1e-6)
  codec = codecs.uniform(4, block=64)
  tx = optax.chain(sync.compressed(codec, memory="ef", axis_name=axes), optax.sgd(0.1))
  _, _, m, report = contract.check_on_mesh(tx, mesh4x2, axis_name=axes)
  n = sum(x.size for x in jax.tree.leaves(contract._params(jnp.float32)))  # pylint: disable=protected-access
  shard = -(-n // 2)
  fast = comm.reduce_scatter_bytes(4 * 2 * shard, 2) + comm.all_gather_bytes(4 * shard, 2)
  slow = comm.compressed_bytes(codec, shard, 4, "two_phase")
  assert int(m["wire_bytes"]) == round(fast + slow)
  assert report.wire_bytes(axes=("tensor",)) == fast and report.wire_bytes(axes=("data",)) == slow
  assert {c.dtype for c in report.select(axes=("tensor",))} == {"f32"}


# ---------------------------------------------------------------------------- convergence
def _logistic_task(d=40, per_worker=32, seed=0):
  """Logistic regression whose workers add large opposing linear terms (they cancel in the mean).

  Each worker's own gradient is dominated by +-5 on the first 4 coordinates, so a worker's top-k
  always picks those; without memory, the remaining coordinates are never sent.
  """
  rng = np.random.default_rng(seed)
  w_true = rng.normal(size=d)
  x = rng.normal(size=(W * per_worker, d)).astype(np.float32)
  y = (x @ w_true + 0.5 * rng.normal(size=W * per_worker) > 0).astype(np.float32)
  c = np.zeros((W, d), np.float32)
  c[:, :4] = 5.0 * np.where(np.arange(W) % 2 == 0, 1.0, -1.0)[:, None]

  def loss(p, b):
    z = b["x"] @ p["w"]
    return jnp.mean(optax.sigmoid_binary_cross_entropy(z, b["y"])) + jnp.sum(b["c"][0] * p["w"])

  return {"w": jnp.zeros(d)}, loss, {"x": x, "y": y, "c": c}


def test_top_k_with_memory_tracks_sgd_and_without_stalls(mesh8):
  params, loss, batch = _logistic_task()
  full_loss = jax.jit(lambda p: jnp.mean(optax.sigmoid_binary_cross_entropy(
      batch["x"] @ p["w"], batch["y"])))
  results = {}
  for name, sync_tx in [("sgd", sync.mean()),
                        ("top_k+ef", sync.compressed(codecs.top_k(k=4), memory="ef")),
                        ("top_k", sync.compressed(codecs.top_k(k=4)))]:
    trainer = train.Trainer(loss, optax.chain(sync_tx, optax.sgd(0.5)), mesh8)
    state = trainer.init(params)
    for _ in range(150):
      state, _ = trainer.step(state, batch)
    results[name] = float(full_loss(state.params))
  initial = float(full_loss(params))
  assert results["sgd"] < 0.6 * initial, results
  assert results["top_k+ef"] < results["sgd"] + 0.1 * (initial - results["sgd"]), results
  assert results["top_k"] > results["sgd"] + 0.5 * (initial - results["sgd"]), results


# ---------------------------------------------------------------------------- bytes in state
@pytest.mark.parametrize("codec,memory,collective", [
    (codecs.top_k(0.1), "ef", None),
    (codecs.uniform(3, stochastic=True, block=8), "ef", None),
    (codecs.random_k(0.25), None, None),
    (codecs.cast("bfloat16"), None, None),
    (codecs.sign(), "ef21", "gather"),
], ids=lambda v: getattr(v, "name", str(v)))
def test_bytes_in_state_equal_inspect_and_formula(mesh8, codec, memory, collective):
  tx = optax.chain(sync.compressed(codec, memory=memory, collective=collective, key=KEY),
                   optax.sgd(0.1))
  _, _, m, _ = contract.check_on_mesh(tx, mesh8)  # asserts counted == comm.inspect
  n = sum(x.size for x in jax.tree.leaves(contract._params(jnp.float32)))  # pylint: disable=protected-access
  chosen = collective or ("psum" if codec.linear and codec.name != "cast(bfloat16)"
                          else "two_phase" if codec.linear else codec.collective)
  assert int(m["wire_bytes"]) == round(comm.compressed_bytes(codec, n, W, chosen))


# ---------------------------------------------------------------------------- bad input
def test_bad_input_fails_when_built():
  bad = [
      (lambda: sync.compressed(codecs.top_k(0.1), collective="psum"), "linear"),
      (lambda: sync.compressed(codecs.cast("bfloat16"), collective="psum"), "two_phase"),
      (lambda: sync.compressed(codecs.qsgd()), "key"),
      (lambda: sync.compressed(codecs.random_k(0.1)), "key"),
      (lambda: sync.compressed(codecs.top_k(0.1), memory="ef14"), "memory"),
      (lambda: sync.compressed(codecs.top_k(0.1), collective="ring"), "collective"),
      (lambda: sync.compressed(codecs.top_k(0.1), collective="gather", server_memory=True),
       "server_memory"),
      (lambda: sync.compressed(codecs.top_k(0.1), memory="loco", beta=1.0), "beta"),
      (lambda: sync.compressed("top_k"), "codec"),
      (lambda: sync.compressed(codecs.sign(), memory="ef", memory_dtype=jnp.int8), "memory_dtype"),
  ]
  for make, word in bad:
    with pytest.raises(ValueError, match=word):
      make()
