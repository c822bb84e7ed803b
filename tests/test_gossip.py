"""Gossip: mixing matrices, exact references for D-PSGD / CHOCO-SGD, consensus rate, bytes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, data, models, sync, train

W = 8


def run_steps(trainer, state, batches):
  """Runs len(batches) steps in one jitted scan (fast, and nothing queues up asynchronously)."""
  fn = trainer.step_fn(state, jax.tree.map(lambda b: b[0], batches))

  def body(s, b):
    s, per_worker, sent = fn(s, b)
    return s, (per_worker["loss"].mean(), sent)

  return jax.jit(lambda s, bs: lax.scan(body, s, bs))(state, batches)


def _sharded_rows(mesh, fn, x):
  """Applies fn(row) -> (row, bytes) on every worker; returns (output, bytes, jitted f)."""
  record = {}

  def body(block):
    out, nbytes = fn(block[0])
    record["bytes"] = nbytes
    return jax.tree.map(lambda o: o[None], out)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  return f(x), record["bytes"], f


# ------------------------------------------------------------------ mixing matrices
@pytest.mark.parametrize("n", [2, 3, 4, 6, 8, 9, 16])
def test_every_mixing_matrix_is_doubly_stochastic_and_symmetric_when_undirected(n):
  names = [g for g in sync.GRAPHS if not (g == "torus" and n in (2, 3))]
  for name in names:
    graph = sync.gossip_graph(name, n)
    for m in graph.matrices:
      assert m.shape == (n, n) and (m >= 0).all()
      np.testing.assert_allclose(m.sum(0), 1, atol=1e-12)
      np.testing.assert_allclose(m.sum(1), 1, atol=1e-12)
      if not graph.directed:
        np.testing.assert_allclose(m, m.T, atol=1e-12)
  assert not sync.gossip_graph("ring", n).directed
  assert sync.gossip_graph("exponential", n).directed


def test_graphs_have_the_expected_neighbours():
  eye, shift = np.eye(W), lambda k: np.roll(np.eye(W), k, axis=1)  # x_{i+k} weight in row i
  np.testing.assert_allclose(sync.gossip_graph("ring", W).matrices[0],
                             (eye + shift(1) + shift(-1)) / 3)
  np.testing.assert_allclose(sync.gossip_graph("complete", W).matrices[0], np.full((W, W), 1 / W))
  np.testing.assert_allclose(sync.gossip_graph("exponential", W).matrices[0],
                             (eye + shift(-1) + shift(-2) + shift(-4)) / 4)
  torus = sync.gossip_graph("torus", 9)  # 3 x 3: four neighbours each, weights 1/5
  assert torus.degree() == 4 and np.allclose(torus.matrices[0][torus.matrices[0] > 0], 0.2)
  one_peer = sync.gossip_graph("one_peer_exponential", W)
  assert one_peer.period == 3 and all(one_peer.degree(p) == 1 for p in range(3))
  # Ying et al.: with W a power of two, log2(W) one-peer rounds average exactly.
  product = one_peer.matrices[2] @ one_peer.matrices[1] @ one_peer.matrices[0]
  np.testing.assert_allclose(product, np.full((W, W), 1 / W), atol=1e-12)


# ------------------------------------------------------------------ one gossip round
def test_complete_graph_gossip_equals_exact_mean(mesh8):
  x = jax.random.normal(jax.random.key(0), (W, 37))
  graph = sync.gossip_graph("complete", W)
  out, nbytes, _ = _sharded_rows(mesh8, lambda r: sync.gossip(r, graph, "data"), x)
  exact, _, _ = _sharded_rows(mesh8, lambda r: comm.mean(r, "data"), x)
  np.testing.assert_allclose(out, exact, atol=1e-6)
  np.testing.assert_allclose(out, np.broadcast_to(np.mean(np.asarray(x, np.float64), 0), x.shape),
                             atol=1e-6)
  assert nbytes == (W - 1) * 37 * 4


@pytest.mark.parametrize("name", sync.GRAPHS)
def test_gossip_round_is_the_mixing_matrix(mesh8, name):
  graph = sync.gossip_graph(name, W)
  x = jax.random.normal(jax.random.key(1), (W, 5))
  for phase in range(graph.period):
    out, nbytes, _ = _sharded_rows(mesh8, lambda r, p=phase: sync.gossip(r, graph, "data", p), x)
    np.testing.assert_allclose(out, graph.matrices[phase] @ np.asarray(x, np.float64), atol=1e-6)
    assert nbytes == graph.degree(phase) * 5 * 4
  if graph.period > 1:  # A traced phase (the step counter) selects the matrix at run time.
    f = jax.jit(jax.shard_map(lambda r, p: sync.gossip(r[0], graph, "data", p)[0][None],
                              mesh=mesh8, in_specs=(P("data"), P()), out_specs=P("data")))
    for t in range(2 * graph.period):
      np.testing.assert_allclose(f(x, jnp.int32(t)),
                                 graph.matrices[t % graph.period] @ np.asarray(x, np.float64),
                                 atol=1e-6)


def test_ring_consensus_distance_falls_at_the_second_eigenvalue(mesh8):
  graph = sync.gossip_graph("ring", W)
  lam2 = np.sort(np.abs(np.linalg.eigvalsh(graph.matrices[0])))[-2]  # computed here, not read
  rounds = 40

  def body(block):
    def one(x, _):
      x, _ = sync.gossip(x, graph, "data")
      dist, _ = sync.consensus_distance(x, "data")
      return x, dist
    _, dists = lax.scan(one, block[0], None, length=rounds)
    return dists

  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("data"), out_specs=P()))
  x = jax.random.normal(jax.random.key(2), (W, 64))
  dists = np.asarray(f(x), np.float64)
  assert np.all(np.diff(dists) < 0)
  measured = (dists[-1] / dists[9]) ** (1 / (rounds - 10))  # after the fast modes have died
  assert abs(measured - lam2) < 0.01 * lam2, (measured, lam2)
  # The in-step measurement agrees with the host-side one on the stacked values.
  x_np = np.asarray(x, np.float64)
  assert np.isclose(sync.stacked_consensus_distance(graph.matrices[0] @ x_np), dists[0],
                    rtol=1e-5)


# ------------------------------------------------------------------ transforms, exact references
def _quadratic(d=6):
  b = np.random.default_rng(0).normal(size=(W, d)).astype(np.float32)
  loss = lambda p, batch: 0.5 * jnp.sum((p["x"] - batch["b"][0]) ** 2)
  return b, loss, {"x": jnp.zeros(d)}


@pytest.mark.parametrize("name", ["ring", "one_peer_exponential"])
def test_dpsgd_equals_mixing_matrix_reference(mesh8, name):
  b, loss, params = _quadratic()
  graph, lr, steps = sync.gossip_graph(name, W), 0.3, 4
  trainer = train.Trainer(loss, sync.dpsgd(optax.sgd(lr), graph), mesh8)
  state = trainer.init(params)
  assert all(jax.tree.leaves(trainer.layout.params))  # params became per-worker
  state, _ = run_steps(trainer, state, {"b": np.broadcast_to(b, (steps, W, b.shape[1]))})
  x = np.zeros_like(b, np.float64)
  for t in range(steps):  # Lian et al.: x <- M_t x - lr * grad(x)
    x = graph.matrices[t % graph.period] @ x - lr * (x - b)
  np.testing.assert_allclose(state.params["x"], x, atol=1e-5)


def test_choco_with_identity_codec_is_gossip_of_the_half_step(mesh8):
  b, loss, params = _quadratic()
  graph, lr, steps = sync.gossip_graph("ring", W), 0.3, 4
  trainer = train.Trainer(loss, sync.choco(optax.sgd(lr), graph, codecs.identity()), mesh8)
  state, _ = run_steps(trainer, trainer.init(params),
                       {"b": np.broadcast_to(b, (steps, W, b.shape[1]))})
  x = np.zeros_like(b, np.float64)
  for _ in range(steps):
    x = graph.matrices[0] @ (x - lr * (x - b))
  np.testing.assert_allclose(state.params["x"], x, atol=1e-5)


def _np_top_k(rows, k):
  """numpy reference of codecs.top_k(k=k): the k largest magnitudes of each row, kept."""
  keep = np.argsort(-np.abs(rows), axis=-1, kind="stable")[:, :k]
  out = np.zeros_like(rows)
  np.put_along_axis(out, keep, np.take_along_axis(rows, keep, axis=-1), axis=-1)
  return out


def test_choco_top_k_matches_numpy_reference(mesh8):
  """Koloskova et al. (arXiv 1902.00340), Algorithm 2, with the library's top-k, on a ring."""
  b, loss, params = _quadratic(d=10)
  graph, lr, gamma, steps, k = sync.gossip_graph("ring", W), 0.3, 0.5, 5, 3
  tx = sync.choco(optax.sgd(lr), graph, codecs.top_k(k=k), consensus_step=gamma)
  trainer = train.Trainer(loss, tx, mesh8)
  state, _ = run_steps(trainer, trainer.init(params),
                       {"b": np.broadcast_to(b, (steps, W, b.shape[1]))})
  x = np.zeros_like(b)          # x_i
  public = np.zeros_like(b)     # x_hat_i
  mixed = np.zeros_like(b)      # sum_j M_ij x_hat_j
  m = graph.matrices[0].astype(np.float32)
  for _ in range(steps):
    half = x - lr * (x - b)
    q = _np_top_k(half - public, k)
    public = public + q
    mixed = mixed + m @ q
    x = half + gamma * (mixed - public)
  np.testing.assert_allclose(state.params["x"], x, atol=1e-5)
  np.testing.assert_allclose(state.opt_state.public, public, atol=1e-5)
  assert np.abs(x - (m @ half)).max() > 1e-2  # compression changed the result


@pytest.mark.parametrize("codec", [codecs.top_k(0.1), codecs.sign()], ids=["top_k", "sign"])
def test_choco_compressed_converges_on_quadratic(mesh8, codec):
  b, loss, params = _quadratic(d=50)
  steps = 300
  lr = optax.linear_schedule(0.2, 0.0, 200)  # then 100 steps of pure compressed gossip
  tx = sync.choco(optax.sgd(lr), "ring", codec, num_workers=W, consensus_step=0.25)
  trainer = train.Trainer(loss, tx, mesh8)
  state, _ = run_steps(trainer, trainer.init(params),
                       {"b": np.broadcast_to(b, (steps, W, b.shape[1]))})
  x, optimum = np.asarray(state.params["x"]), b.mean(0)
  spread = np.abs(b - optimum).max()
  assert np.abs(x.mean(0) - optimum).max() < 1e-4  # gossip keeps the average exact
  assert np.abs(x - optimum).max() < 0.02 * spread, np.abs(x - optimum).max()


@pytest.fixture(scope="module")
def mlp_task():
  model = models.MLP(hidden=(32,), num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, batch: models.classifier_loss(model)(p, batch)[0]
  ds = data.digits()
  steps = 250
  batches = [ds.batch(t, 128) for t in range(steps)]
  batches = jax.tree.map(lambda *xs: np.stack(xs), *batches)
  full_loss = jax.jit(lambda p: loss(p, ds.all()))
  return loss, params, batches, full_loss


def _mlp_final_loss(mesh, task, tx):
  """(loss of the averaged model, mean loss of every worker's own model, consensus distance)."""
  loss, params, batches, full_loss = task
  trainer = train.Trainer(loss, tx, mesh)
  state, _ = run_steps(trainer, trainer.init(params), batches)
  if not jax.tree.leaves(trainer.layout.params)[0]:
    exact = float(full_loss(state.params))
    return exact, exact, 0.0
  host = jax.tree.map(np.asarray, state.params)
  averaged = float(full_loss(jax.tree.map(lambda x: x.mean(0), host)))
  # Every worker's own model, scored on the full dataset: disagreement is not hidden.
  own = np.mean([float(full_loss(jax.tree.map(lambda x, w=w: x[w], host))) for w in range(W)])
  return averaged, float(own), sync.stacked_consensus_distance(host)


@pytest.mark.slow
def test_dpsgd_ring_and_choco_reach_exact_dp_loss_on_mlp(mesh8, mlp_task):
  lr = 0.1
  dp, _, _ = _mlp_final_loss(mesh8, mlp_task, optax.chain(sync.mean("data"), optax.sgd(lr)))
  assert dp < 0.4  # from 2.3: a real training run
  averaged, own, dist = _mlp_final_loss(mesh8, mlp_task,
                                        sync.dpsgd(optax.sgd(lr), "ring", num_workers=W))
  assert dist > 0  # the workers really did differ
  assert abs(averaged - dp) < 0.03 * dp and abs(own - dp) < 0.06 * dp, (averaged, own, dp)
  for codec in (codecs.top_k(0.1), codecs.sign()):
    tx = sync.choco(optax.sgd(lr), "ring", codec, num_workers=W, consensus_step=0.3)
    averaged, own, _ = _mlp_final_loss(mesh8, mlp_task, tx)
    assert abs(averaged - dp) < 0.03 * dp and abs(own - dp) < 0.06 * dp, \
        (codec.name, averaged, own, dp)


# ------------------------------------------------------------------ bytes
def _bytes_three_ways(mesh, tx, params, loss, batch):
  trainer = train.Trainer(loss, tx, mesh)
  state = trainer.init(params)
  fn = trainer.step_fn(state, batch)
  report = comm.inspect(fn, state, batch)
  counted = []
  for _ in range(3):
    state, _, sent = fn(state, batch)
    counted.append(int(sent))
  return counted, report


@pytest.mark.parametrize("name", sync.GRAPHS)
def test_dpsgd_bytes_counted_equal_inspect_and_formula(mesh8, name):
  b, loss, params = _quadratic(d=10)
  batch = {"b": b}
  graph = sync.gossip_graph(name, W)
  counted, report = _bytes_three_ways(mesh8, sync.dpsgd(optax.sgd(0.1), graph), params, loss,
                                      batch)
  per_neighbour = 10 * 4  # one f32[10] buffer to each peer: k * s * b
  assert {c.op for c in report} == {"collective-permute"}
  assert {c.axes for c in report} == {("data",)}
  if graph.period == 1:
    assert counted == [graph.degree() * per_neighbour] * 3 == [report.wire_bytes()] * 3
  else:  # one branch per phase; each step runs one of them
    assert counted == [graph.degree(t % graph.period) * per_neighbour for t in range(3)]
    assert report.wire_bytes(conditional=True) == sum(counted) == report.wire_bytes()


def test_choco_and_consensus_measurement_bytes(mesh8):
  b, loss, params = _quadratic(d=40)
  batch = {"b": b}
  counted, report = _bytes_three_ways(
      mesh8, sync.choco(optax.sgd(0.1), "ring", codecs.top_k(0.1), num_workers=W), params,
      loss, batch)
  # top-4 of 40: 4 (f32 value, u8 index) pairs = 20 bytes to each of the 2 ring neighbours.
  assert counted == [40] * 3 == [report.wire_bytes()] * 3
  assert {c.dtype for c in report} == {"u32", "u8"}  # f32 values as bits, u8 indices
  # bf16 payloads travel as their bits.
  counted, report = _bytes_three_ways(
      mesh8, sync.choco(optax.sgd(0.1), "ring", codecs.cast("bfloat16"), num_workers=W),
      params, loss, batch)
  assert counted == [160] * 3 == [report.wire_bytes()] * 3  # 40 x 2 bytes to 2 neighbours
  assert {c.dtype for c in report} == {"u16"}
  # The exact consensus measurement costs one all-reduce of the params and one of a scalar.
  counted, report = _bytes_three_ways(
      mesh8, sync.dpsgd(optax.sgd(0.1), "ring", num_workers=W, measure_consensus=True),
      params, loss, batch)
  allreduce = 280 + 7  # the parameters, 2 * 7/8 * 160, and a scalar, 2 * 7/8 * 4
  assert counted[0] == 2 * 160 + allreduce == round(report.wire_bytes())
  assert report.wire_bytes(op="all-reduce") == allreduce


def test_measured_consensus_distance_in_state(mesh8):
  b, loss, params = _quadratic(d=10)
  tx = sync.dpsgd(optax.sgd(0.5), "ring", num_workers=W, measure_consensus=True)
  trainer = train.Trainer(loss, tx, mesh8)
  state, _ = run_steps(trainer, trainer.init(params), {"b": np.broadcast_to(b, (3, W, 10))})
  measured = float(state.opt_state.consensus_distance)
  assert measured > 0
  assert np.isclose(measured, sync.stacked_consensus_distance(state.params), rtol=1e-5)


# ------------------------------------------------------------------ contract and bad input
@pytest.mark.parametrize("make", [
    lambda: sync.dpsgd(optax.sgd(0.1, momentum=0.5), "ring", num_workers=W, axis_name=None),
    lambda: sync.choco(optax.sgd(0.1), "ring", codecs.sign(), num_workers=W, axis_name=None),
], ids=["dpsgd", "choco"])
def test_contract_on_one_device(make):
  tx = make()
  params = {"w": jnp.array([3.0, -2.0]), "b": jnp.ones((), jnp.bfloat16)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  chex.assert_trees_all_equal_shapes_and_dtypes(jax.eval_shape(tx.init, abstract),
                                                tx.init(params))
  update = jax.jit(tx.update)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  u, new_state = update(grads, state, params)
  u, new_state = update(grads, new_state, params)
  assert update._cache_size() == 1
  chex.assert_trees_all_equal_structs(state, new_state)
  assert jax.tree.map(lambda x: x.dtype, u) == jax.tree.map(lambda x: x.dtype, params)

  def step(carry, _):
    p, s = carry
    g = jax.grad(lambda q: jnp.sum(q["w"].astype(jnp.float32) ** 2))(p)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), None

  (p, _), _ = lax.scan(step, (params, state), None, length=100)
  assert float(jnp.abs(p["w"]).max()) < 1e-2


def test_bad_input_fails_at_build(mesh8):
  with pytest.raises(ValueError, match="graph must be one of 'ring'"):
    sync.gossip_graph("hypercube", W)
  with pytest.raises(ValueError, match="num_workers"):
    sync.gossip_graph("ring", 1)
  with pytest.raises(ValueError, match="torus shape"):
    sync.gossip_graph("torus", W, shape=(3, 3))
  with pytest.raises(ValueError, match="factorisation"):
    sync.gossip_graph("torus", 7)
  with pytest.raises(ValueError, match="needs num_workers"):
    sync.dpsgd(optax.sgd(0.1), "ring")
  with pytest.raises(ValueError, match="static graph"):
    sync.choco(optax.sgd(0.1), "one_peer_exponential", codecs.identity(), num_workers=W)
  with pytest.raises(ValueError, match="consensus_step"):
    sync.choco(optax.sgd(0.1), "ring", codecs.identity(), num_workers=W, consensus_step=0.0)
  with pytest.raises(ValueError, match="codec"):
    sync.choco(optax.sgd(0.1), "ring", "top_k", num_workers=W)
  # A graph for 4 workers on an 8-worker axis: caught when the Trainer is built.
  _, loss, params = _quadratic()
  trainer = train.Trainer(loss, sync.dpsgd(optax.sgd(0.1), "ring", num_workers=4), mesh8)
  with pytest.raises(ValueError, match="has 4 workers but the mesh axis"):
    trainer.init(params)
