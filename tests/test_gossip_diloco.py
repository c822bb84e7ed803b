"""Gossip DiLoCo (`local.factored_gossip_diloco`, `local.gasloc`) and Pier (`local.pier`):
numpy references of the rules on data=8, the complete graph = DiLoCo, the ring's consensus
rate at its second eigenvalue, a constant momentum = DiLoCo, bytes counted == compiled ==
derived by hand, the replicas of a sharded model = unsharded workers, bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm import local, parallel, sync, train
from tests.test_muon_variants import SPECS, mesh_setup  # noqa: F401 (a fixture)
from tests.test_replicas import R, compile_step, gradients, host, layout_scales, linear_loss
from tests.test_replicas import run_against_unsharded

W, H, ROUNDS = 8, 2, 4
INNER_LR, OUTER_LR, MU = 0.1, 0.7, 0.9
SHAPES = {"a": (6, 4), "b": (4,)}  # 28 floats: 112 bytes


def _grads(steps=H * ROUNDS, seed=0):
  """Per step, every worker's gradient: leaves [W, *shape]."""
  rng = np.random.default_rng(seed)
  return [{k: rng.normal(size=(W, *s)).astype(np.float32) for k, s in SHAPES.items()}
          for _ in range(steps)]


def _params():
  return {k: jnp.asarray(np.linspace(-1, 1, int(np.prod(s))).reshape(s), jnp.float32)
          for k, s in SHAPES.items()}


def _run(tx, grads):
  """(every worker's parameters as a [W, 28] array after the steps, bytes counted per step,
  the compiled step's report)."""
  mesh = parallel.make_mesh({"data": W})
  trainer = train.Trainer(linear_loss(jax.tree.map(lambda _: 1.0, _params())), tx, mesh)
  state = trainer.init(_params())
  compiled, report = compile_step(trainer, state, grads[0])
  sent = []
  for g in grads:
    state, _, nbytes = compiled(state, g)
    sent.append(int(nbytes))
  workers = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(host(
      trainer.worker_view(state.params, trainer.layout.params, w)))]) for w in range(W)]
  return np.stack(workers), sent, report


def ring_matrix():
  """The ring's Metropolis-Hastings weights, written here: 1/3 to self and each neighbour."""
  shift = np.roll(np.eye(W), 1, axis=1)
  return (np.eye(W) + shift + shift.T) / 3


def reference(grads, rule, momenta=None):
  """DiLoCo with per-worker outer Nesterov SGD in float64; `rule(x, u, k) -> x` combines the
  workers' outer parameters x [W, n] and outer steps u [W, n] of round k; `momenta[k]`: the
  outer momentum of round k (default MU)."""
  x = np.tile(np.concatenate([np.ravel(v) for v in jax.tree.leaves(_params())]), (W, 1))
  x = x.astype(np.float64)
  theta, m = x.copy(), np.zeros_like(x)
  for t, g in enumerate(grads, start=1):
    theta -= INNER_LR * np.concatenate([g[k].reshape(W, -1) for k in sorted(g)], axis=1)
    if t % H == 0:
      k = t // H - 1
      mu = MU if momenta is None else momenta[k]
      delta = x - theta
      m = mu * m + delta
      x = rule(x, -OUTER_LR * (delta + mu * m), k)
      theta = x.copy()
  return x


OUTER = lambda: optax.sgd(OUTER_LR, momentum=MU, nesterov=True)


@pytest.fixture(scope="module")
def diloco_run():
  return _run(local.diloco(optax.sgd(INNER_LR), OUTER(), H), _grads())


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    lambda g: local.factored_gossip_diloco(optax.sgd(INNER_LR), OUTER(), H, g),
    lambda g: local.gasloc(optax.sgd(INNER_LR), OUTER(), H, g)], ids=["factored", "gasloc"])
def test_complete_graph_with_a_mixing_step_every_round_is_diloco(diloco_run, make):
  got, _, _ = _run(make(sync.gossip_graph("complete", W)), _grads())
  np.testing.assert_allclose(got, diloco_run[0], rtol=1e-5, atol=1e-6)
  assert np.ptp(got, axis=0).max() < 1e-6  # one model


@pytest.fixture(scope="module")
def ring_runs():
  ring = sync.gossip_graph("ring", W)
  return {
      "factored": _run(local.factored_gossip_diloco(optax.sgd(INNER_LR), OUTER(), H, ring,
                                                     blocking_every=2), _grads()),
      "gasloc": _run(local.gasloc(optax.sgd(INNER_LR), OUTER(), H, ring, gossip_step=0.5,
                                  momentum=0.3), _grads()),
  }


def _factored(x, u, k):
  mix = ring_matrix()
  return mix @ x + (mix @ u if (k + 1) % 2 == 0 else u)


def _gasloc(state):
  def rule(x, u, k):
    y = x + u
    new = y + 0.5 * (ring_matrix() @ y - y) + (0.3 * (y - state["prev"]) if k else 0.0)
    state["prev"] = y
    return new
  return rule


@pytest.mark.slow
@pytest.mark.parametrize("name", ["factored", "gasloc"])
def test_ring_rounds_equal_the_numpy_reference(ring_runs, name):
  """Factored: blocking gossip on rounds 2 and 4 only. GASLoC accelerated: a = 0.5, g = 0.3.
  Four rounds of H = 2 steps with every worker's own gradients: the workers differ."""
  rule = _factored if name == "factored" else _gasloc({})
  got, _, _ = ring_runs[name]
  np.testing.assert_allclose(got, reference(_grads(), rule), rtol=1e-5, atol=1e-5)
  assert np.ptp(got, axis=0).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["factored", "gasloc"])
def test_ring_bytes_counted_compiled_and_by_hand(ring_runs, name):
  """A gossip sends the 28 floats (112 bytes) to each of the ring's 2 neighbours: 224 bytes.
  Factored: one gossip per round, two on blocking rounds; GASLoC: one per round."""
  _, sent, report = ring_runs[name]
  rounds = [224, 448] * 2 if name == "factored" else [224] * 4
  assert sent == [b for r in rounds for b in (0, r)]
  assert {c.op for c in report} == {"collective-permute"}
  assert all(c.in_conditional for c in report)
  assert report.wire_bytes() == pytest.approx(448 if name == "factored" else 224)


@pytest.mark.slow
@pytest.mark.parametrize("name,gossip_step", [("factored", 1.0), ("gasloc", 0.5)])
def test_ring_consensus_falls_at_the_spectral_gap_rate(name, gossip_step):
  """No progress after a first round of different gradients: each round multiplies the
  disagreement by the second eigenvalue of the (lazy, a < 1) mixing matrix."""
  ring = sync.gossip_graph("ring", W)
  lam = np.sort(np.linalg.eigvalsh(ring_matrix()))[-2]  # (1 + 2 cos(2 pi / 8)) / 3
  lam = 1 - gossip_step + gossip_step * lam
  tx = (local.factored_gossip_diloco(optax.sgd(1.0), optax.sgd(1.0), 1, ring,
                                     blocking_every=10**6) if name == "factored" else
        local.gasloc(optax.sgd(1.0), optax.sgd(1.0), 1, ring, gossip_step=gossip_step))
  mesh = parallel.make_mesh({"data": W})
  trainer = train.Trainer(linear_loss({"x": 1.0}), tx, mesh)
  state = trainer.init({"x": jnp.zeros(16)})
  grads = np.zeros((41, W, 16), np.float32)
  grads[0] = np.random.default_rng(1).normal(size=(W, 16))
  fn = trainer.step_fn(state, {"x": grads[0]})

  def body(s, g):
    s, _, _ = fn(s, {"x": g})
    return s, s.params["x"]

  _, xs = jax.jit(lambda s, gs: lax.scan(body, s, gs))(state, grads)
  dists = [sync.stacked_consensus_distance(np.asarray(x)) for x in xs]
  measured = (dists[-1] / dists[10]) ** (1 / 30)
  assert abs(measured - lam) < 0.01 * lam, (measured, lam)


# ------------------------------------------------------------------------------------ Pier
@pytest.mark.slow
def test_pier_constant_momentum_is_diloco(diloco_run):
  got, sent, _ = _run(local.pier(optax.sgd(INNER_LR), H, momentum=MU), _grads())
  np.testing.assert_allclose(got, diloco_run[0], rtol=1e-6, atol=1e-7)
  assert sent == diloco_run[1]


@pytest.mark.slow
def test_pier_momentum_schedule_equals_the_reference():
  """Momentum warm-up over 2 outer steps (0, 0.45) then 0.9, against DiLoCo's exact mean."""
  schedule = local.pier_momentum(MU, 2)
  got, _, _ = _run(local.pier(optax.sgd(INNER_LR), H, momentum=schedule), _grads())
  mean = lambda x, u, k: np.tile((x + u).mean(axis=0), (W, 1))
  want = reference(_grads(), mean, momenta=[0.0, 0.45, MU, MU])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------- over the replicas of a sharded model (R = 2)
@pytest.mark.slow
def test_replicas_of_a_sharded_model_equal_unsharded_workers(mesh_setup):  # noqa: F811
  """replica=2,fsdp=2,tensor=2, the three methods in one program (one copy of the sharded
  matrices each): every replica's shards gossip over `replica` (the 2-worker ring) and equal
  2 unsharded workers after 2 rounds; the replicas differ between rounds."""
  layout, small, _ = mesh_setup
  methods = {
      "factored": local.factored_gossip_diloco(optax.sgd(0.1), OUTER(), 2,
                                               sync.gossip_graph("ring", R),
                                               axis_name="replica"),
      "gasloc": local.gasloc(optax.sgd(0.1), OUTER(), 2, "ring", num_workers=R, momentum=0.5,
                             gossip_step=0.5, axis_name="replica"),
      "pier": local.pier(optax.sgd(0.1), 2, "replica", momentum=local.pier_momentum(MU, 1))}
  params = {n: small for n in methods}
  specs = {n: SPECS for n in methods}
  labels = {n: {k: n for k in SPECS} for n in methods}
  method = lambda s: optax.multi_transform(methods, labels)
  trainer = train.Trainer(linear_loss(layout_scales(layout, specs)),
                          layout.optimizer(method(specs), specs), layout.mesh,
                          batch_axes=layout.batch_axes, param_specs=specs,
                          batch_specs=jax.tree.map(lambda s: P("replica", *s), specs,
                                                   is_leaf=lambda s: isinstance(s, P)))
  mesh2 = parallel.make_mesh({"replica": R}, devices=jax.devices()[:R])
  grads = gradients(params, 3)  # the third step is mid-round: the replicas differ
  state, ref, ref_state, _, _ = run_against_unsharded(trainer, method, params, specs, mesh2,
                                                      grads)
  fsdp = trainer.mesh.shape["fsdp"]
  views = [host(trainer.worker_view(state.params, trainer.layout.params, r * fsdp))
           for r in range(R)]
  for replica in range(R):
    want = ref.worker_view(ref_state.params, ref.layout.params, replica)
    chex.assert_trees_all_close(views[replica], host(want), rtol=1e-5, atol=1e-6)
  for n in methods:
    assert max(np.max(np.abs(a - b)) for a, b in zip(
        jax.tree.leaves(views[0][n]), jax.tree.leaves(views[1][n]))) > 1e-3, n


def test_bad_input_fails_when_built():
  ring = sync.gossip_graph("ring", W)
  inner, outer = optax.sgd(0.1), optax.sgd(1.0)
  for make, word in [
      (lambda: local.factored_gossip_diloco(inner, outer, 2, ring, blocking_every=0),
       "blocking_every"),
      (lambda: local.factored_gossip_diloco(inner, outer, 2, sync.random_matchings(W, 1)),
       "does not connect"),
      (lambda: local.gasloc(inner, outer, 2, "ring"), "num_workers"),
      (lambda: local.gasloc(inner, outer, 2, ring, gossip_step=0.0), "gossip_step"),
      (lambda: local.gasloc(inner, outer, 2, ring, momentum=1.0), "momentum"),
      (lambda: local.gasloc(inner, outer, 0, ring), "sync_every"),
      (lambda: local.pier(inner, 2, momentum=1.0), "momentum"),
      (lambda: local.pier(inner, 2, outer=outer), "outer"),
      (lambda: local.pier_momentum(0.9, 2, decay_from=5), "decay_from"),
      (lambda: local.pier_momentum(0.9, 4, decay_from=2, total=8), "decay_from")]:
    with pytest.raises(ValueError, match=word):
      make()
  local.gasloc(inner, outer, 2, sync.random_matchings(W, 8))  # connected over its phases
