"""DES-LOC, NoLoCo, eager DiLoCo and per-replica periods against references of W workers.

Same task and conventions as tests/test_local.py (tiny MLP on digits, 8 workers, worker
parameters stacked [W, ...] in the references, gradients by vmap on one device). Bytes are
held three ways: counted in state, `comm.inspect` of the compiled step, and a formula written
here for the MLP's n = 1210 float32 parameters (4840 bytes).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from jaxcomm import comm, data, local, models, sim, sync
from test_local import B, LR, NESTEROV, W, blocks, close, run_trainer, stack

THETA = 4840                      # |θ| b: 1210 float32
ALLREDUCE = 2 * THETA * (W - 1) // W  # 8470: one all-reduce of |θ| on 8 workers


@pytest.fixture(scope="module")
def task():
  """test_local's task: the MLP 64 -> 16 -> 10 on digits, 8 batches, per-worker gradients."""
  model = models.MLP(hidden=(16,), num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  ds = data.digits()
  return params, loss, [ds.batch(t, B) for t in range(8)], jax.jit(jax.vmap(jax.grad(loss)))


def inspect(trainer, state, batch):
  return comm.inspect(trainer.step_fn(state, batch), state, batch)


def sgd_steps(task, ps, t):
  """Every worker takes one SGD(LR) step on its block of batch t - 1."""
  _, _, batches, grads = task
  return jax.tree.map(lambda p, g: p - LR * g, ps, grads(ps, blocks(batches[t - 1])))


def wmean(stacked, weights=None):
  weights = np.ones(W) if weights is None else np.asarray(weights, np.float32)
  return jax.tree.map(lambda x: jnp.tensordot(jnp.asarray(weights), x, 1) / weights.sum(),
                      stacked)


# ------------------------------------------------------------------ DES-LOC
def test_des_loc_all_periods_one_with_momentum_equals_dp(task):
  params, loss, batches, _ = task
  momentum = optax.sgd(LR, momentum=0.9)
  _, dp, _ = run_trainer(loss, optax.chain(sync.mean("data"), momentum), params, batches, 3)
  _, dl, sent = run_trainer(loss, local.des_loc(momentum, 1, {"trace": 1}), params, batches, 3)
  close(jax.tree.map(lambda x: x[W - 1], dl.params), dp.params)
  assert sent == [2 * ALLREDUCE] * 3  # parameters and momentum, every step


DES_MASK = np.ones((6, W), bool)  # per update: at t = 3 (μ) worker 7 is dropped, at t = 6
DES_MASK[2, 7] = False            # (θ, μ and ν) workers 0 and 1
DES_MASK[5, :2] = False


def test_des_loc_adam_matches_reference_and_bytes(task):
  """K_x = 2, K_u = 3, K_v = 6 over 6 steps: at t = 6 all three sync; with dropped workers
  (DES_MASK): each average is over the live workers, and every worker takes it.

  eps = 1e-3: with Adam's 1e-8 a coordinate whose gradient is zero on one worker (a digits
  pixel that is blank in its 8 examples) has ν ≈ 0 there, and once μ is averaged that
  worker steps μ/√ν by ~40 (both here and in the reference): a property of desynced
  moments, kept out of this comparison of float32 rounding.
  """
  params, loss, batches, grads = task
  lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-3
  tx = local.des_loc(optax.adam(lr, eps=eps), 2, {"mu": 3, "nu": 6}, participation=DES_MASK)
  trainer, state, sent = run_trainer(loss, tx, params, batches, 6)
  ps = stack(params)
  m = jax.tree.map(jnp.zeros_like, ps)
  v = jax.tree.map(jnp.zeros_like, ps)
  for t in range(1, 7):
    mean_all = lambda tree: stack(wmean(tree, DES_MASK[t - 1]))
    g = grads(ps, blocks(batches[t - 1]))
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
    ps = jax.tree.map(lambda p, m, v: p - lr * (m / (1 - b1**t)) / (
        jnp.sqrt(v / (1 - b2**t)) + eps), ps, m, v)
    m = mean_all(m) if t % 3 == 0 else m
    v = mean_all(v) if t % 6 == 0 else v
    ps = mean_all(ps) if t % 2 == 0 else ps
  close(state.params, ps, atol=1e-6)
  adam = state.opt_state.inner_state[0]
  close(adam.mu, m)
  close(adam.nu, v, atol=1e-9)
  # t = 2, 4: θ; t = 3: μ; t = 6: θ, μ and ν: |θ| b (1/2 + 1/3 + 1/6) * 2 (W-1)/W per step.
  assert sent == [0, ALLREDUCE, ALLREDUCE, ALLREDUCE, 0, 3 * ALLREDUCE]
  assert sum(sent) == pytest.approx(6 * THETA * (1 / 2 + 1 / 3 + 1 / 6) * 2 * (W - 1) / W)
  report = inspect(trainer, state, batches[0])
  assert report.wire_bytes(conditional=False) == 0
  assert report.wire_bytes(conditional=True) == 3 * ALLREDUCE  # one branch per class
  assert {c.op for c in report} == {"all-reduce"}


def test_des_loc_bad_input():
  with pytest.raises(ValueError, match="state_every"):
    local.des_loc(optax.adam(0.1), 2, {"mu": 0})
  with pytest.raises(ValueError, match="state_every"):
    local.des_loc(optax.adam(0.1), 2, ["mu"])
  with pytest.raises(ValueError, match=r"fields \['trace'\].*'mu', 'nu'"):
    local.des_loc(optax.adam(0.1), 2, {"trace": 2}).init({"w": jnp.ones(2)})


# ------------------------------------------------------------------ NoLoCo
def np_pairs(count, seed):
  """partner[k][i]: worker i's partner in matching k (pairs π[2i], π[2i+1] of a permutation)."""
  rng, out = np.random.default_rng(seed), []
  for _ in range(count):
    perm, partner = rng.permutation(W), np.empty(W, int)
    partner[perm[0::2]], partner[perm[1::2]] = perm[1::2], perm[0::2]
    out.append(partner)
  return out


def test_noloco_matches_reference_with_the_same_pairs_and_bytes(task):
  params, loss, batches, grads = task
  h, beta, alpha, gamma, count, seed = 2, 0.7, 0.5, 0.5, 2, 3
  mask = np.ones((3, W), bool)
  mask[1, 3] = False  # outer step 1: worker 3 dropped, its partner steps alone
  tx = local.noloco(optax.sgd(LR), h, outer_lr=beta, momentum=alpha, gamma=gamma,
                    matchings=count, seed=seed, participation=mask)
  trainer, state, sent = run_trainer(loss, tx, params, batches, 6)
  _, unravel = ravel_pytree(params)
  vec = lambda tree: np.stack([ravel_pytree(jax.tree.map(lambda x: np.asarray(x)[w], tree))[0]
                               for w in range(W)])
  tree = lambda rows: jax.tree.map(lambda *xs: jnp.stack(xs), *[unravel(r) for r in rows])
  pairs = np_pairs(count, seed)
  assert not np.array_equal(pairs[0], pairs[1])
  x = np.stack([ravel_pytree(params)[0]] * W)  # [W, n]: worker parameters
  phi, delta = x.copy(), np.zeros_like(x)
  for t in range(1, 7):
    x = vec(sgd_steps(task, tree(x), t))
    if t % h == 0:
      live = mask[t // h - 1]
      j = pairs[(t // h - 1) % count]
      j = np.where(live & live[j], j, np.arange(W))  # a lone live worker is its own partner
      grad = phi - x
      new = alpha * delta - beta / 2 * (grad + grad[j]) - gamma * (phi - (phi + phi[j]) / 2)
      delta = np.where(live[:, None], new, delta)  # a dropped worker keeps φ and δ
      phi = np.where(live[:, None], phi + new, phi)
      x = phi.copy()
  np.testing.assert_allclose(vec(state.params), x, atol=1e-5)
  np.testing.assert_allclose(vec(state.opt_state.outer_params), phi, atol=1e-5)
  assert sent == [0, THETA] * 3  # one |θ| to one partner per outer step
  report = inspect(trainer, state, batches[0])
  assert {c.op for c in report} == {"collective-permute"}
  assert report.wire_bytes(conditional=False) == 0
  # One branch per matching, each a single ppermute of |θ| (the leaves fused: one message,
  # one latency on the clock).
  assert len(report) == len({c.branch for c in report}) == count
  assert report.wire_bytes(conditional=True) == count * THETA


def test_random_matchings_are_the_drawn_pairs():
  graph = sync.random_matchings(W, 4, seed=5)
  for p, partner in enumerate(np_pairs(4, 5)):
    np.testing.assert_array_equal(graph.sources[p], [partner])  # one ppermute
    np.testing.assert_allclose(graph.matrices[p], (np.eye(W) + np.eye(W)[partner]) / 2)
  with pytest.raises(ValueError, match="even"):
    sync.random_matchings(7)


# ------------------------------------------------------------------ eager outer updates
def ref_eager(task, outer, h, steps):
  """Per-worker outer parameters and state; the mean of sync k is used at sync k + 1."""
  params = task[0]
  theta = stack(params)
  o = jax.vmap(outer.init)(theta)
  in_flight = jax.tree.map(jnp.zeros_like, params)
  sent = jax.tree.map(jnp.zeros_like, theta)
  ps = theta
  for t in range(1, steps + 1):
    ps = sgd_steps(task, ps, t)
    if t % h == 0:
      delta = jax.tree.map(jnp.subtract, theta, ps)
      share = jax.tree.map(lambda d: d / W, delta)
      g = jax.tree.map(lambda a, s, p: a + s - p, stack(in_flight), share, sent)
      step, o = jax.vmap(outer.update)(g, o, theta)
      theta = optax.apply_updates(theta, step)
      in_flight, sent, ps = wmean(delta), share, theta
  return ps, theta, o


def test_eager_diloco_matches_reference_with_corrections_and_bytes(task):
  params, loss, batches, _ = task
  tx = local.diloco(optax.sgd(LR), NESTEROV, 2, eager=True)
  trainer, state, sent = run_trainer(loss, tx, params, batches, 6)
  ps, theta, o = ref_eager(task, NESTEROV, 2, 6)
  close(state.params, ps)
  close(state.opt_state.outer_params, theta)
  close(state.opt_state.outer_state, o)
  assert sent == [0, ALLREDUCE] * 3  # DiLoCo's bytes: the same all-reduce, used later
  report = inspect(trainer, state, batches[0])
  assert report.wire_bytes(conditional=True) == ALLREDUCE
  assert report.wire_bytes(conditional=False) == 0


def test_eager_on_one_worker_is_diloco():
  target = {"a": jnp.arange(4.0), "b": jnp.ones((2, 3))}
  params = jax.tree.map(jnp.zeros_like, target)

  def run(tx):
    p, s = params, tx.init(params)
    for _ in range(6):
      u, s = tx.update(jax.tree.map(jnp.subtract, p, target), s, p)
      p = optax.apply_updates(p, u)
    return p

  plain = run(local.diloco(optax.sgd(0.1), NESTEROV, 2, None))
  eager = run(local.diloco(optax.sgd(0.1), NESTEROV, 2, None, eager=True))
  close(eager, plain)
  assert not np.allclose(plain["a"], 0)


# Streaming DiLoCo, eager: H = 2, P = 2 fragments of 605 (element i to fragment i mod 2),
# fragment 1 syncs at t = 1, 3, 5 and fragment 0 at t = 2, 4, 6 (sync index k = t - 1),
# merged tau = 1 update later with alpha = 0.5; at sync k = 2 workers 0 and 1 are dropped.
FRAGMENT = 2 * 2420 * (W - 1) // W  # 4235: one all-reduce of 605 float32 on 8 workers
STREAM_MASK = np.ones((6, W), bool)
STREAM_MASK[2, :2] = False


def ref_streaming_eager(task, h, frags, tau, alpha, steps, mask):
  """numpy: per-worker outer fragments and momentum; fragment p's mean is used at its next
  sync, each worker's own share (live-weighted) standing in at once."""
  params, _, batches, grads = task
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  theta0, unravel = ravel_pytree(params)
  n = theta0.size
  worker = np.stack([np.asarray(theta0)] * W)
  outer, mom, sent = worker.copy(), np.zeros_like(worker), np.zeros_like(worker)
  in_flight = np.zeros(n, np.float32)
  offsets = [p * h // frags for p in range(frags)]
  elems = lambda p: np.arange(n)[np.arange(n) % frags == p]
  for t in range(1, steps + 1):
    ps = jax.vmap(unravel)(jnp.asarray(worker))
    g = grads(ps, blocks(batches[t - 1]))
    g = jax.tree.map(np.asarray, g)  # on the host: no eager collective per worker row
    worker = worker - LR * np.stack([flat(jax.tree.map(lambda x: x[w], g)) for w in range(W)])
    if t % h in offsets:
      idx, live = elems(offsets.index(t % h)), mask[t - 1].astype(np.float32)
      delta = outer[:, idx] - worker[:, idx]
      share = delta * live[:, None] / live.sum()
      corrected = in_flight[idx] + share - sent[:, idx]
      in_flight[idx], sent[:, idx] = share.sum(0), share
      mom[:, idx] = 0.9 * mom[:, idx] + corrected
      outer[:, idx] = outer[:, idx] - 0.7 * mom[:, idx]
    if t - tau >= 1 and (t - tau) % h in offsets:
      idx = elems(offsets.index((t - tau) % h))
      a = np.where(mask[t - tau - 1], alpha, 0.0)[:, None]
      worker[:, idx] = a * worker[:, idx] + (1 - a) * outer[:, idx]
  return worker, outer


def test_eager_streaming_matches_reference_with_corrections_mask_and_bytes(task):
  params, loss, batches, _ = task
  tx = local.streaming_diloco(optax.sgd(LR), optax.sgd(0.7, momentum=0.9), 2, 2, 1, 0.5,
                              codec=None, participation=STREAM_MASK, eager=True)
  trainer, state, sent = run_trainer(loss, tx, params, batches, 6)
  worker, outer = ref_streaming_eager(task, 2, 2, 1, 0.5, 6, STREAM_MASK)
  got = np.stack([ravel_pytree(jax.tree.map(lambda x: np.asarray(x)[w], state.params))[0]
                  for w in range(W)])
  np.testing.assert_allclose(got, worker, atol=1e-5)
  # Row p of a worker's outer parameters holds elements p, p + 2, ... (dealt like cards).
  got_outer = np.asarray(state.opt_state.outer_params).transpose(0, 2, 1).reshape(W, -1)
  np.testing.assert_allclose(got_outer, outer, atol=1e-5)
  assert not np.allclose(outer[0], outer[2])  # the dropped workers' eager steps differ
  assert sent == [FRAGMENT] * 6  # every update syncs one fragment: Streaming's bytes
  report = inspect(trainer, state, batches[0])
  assert report.wire_bytes(conditional=True) == FRAGMENT
  assert report.wire_bytes(conditional=False) == 0


def test_eager_streaming_on_one_worker_is_streaming():
  target = {"a": jnp.arange(4.0), "b": jnp.ones((2, 3))}
  params = jax.tree.map(jnp.zeros_like, target)

  def run(**kw):
    tx = local.streaming_diloco(optax.sgd(0.1), NESTEROV, 2, 2, 1, 0.5, None, codec=None,
                                **kw)
    p, s = params, tx.init(params)
    for _ in range(6):
      u, s = tx.update(jax.tree.map(jnp.subtract, p, target), s, p)
      p = optax.apply_updates(p, u)
    return p

  plain = run()
  close(run(eager=True), plain)
  assert not np.allclose(plain["a"], 0)
  with pytest.raises(ValueError, match="eager"):
    local.streaming_diloco(optax.sgd(0.1), NESTEROV, 2, eager="yes")
  with pytest.raises(ValueError, match="compensation"):
    local.streaming_diloco(optax.sgd(0.1), NESTEROV, 2, compensation="dc", eager=True)


def test_eager_overlap_on_the_simulated_clock():
  """A sync every 4 steps, its all-reduce 3 compute steps long: blocking DiLoCo pays it every
  period; eager hides it behind the next inner phase and pays only the last one."""
  h, compute, comm_s, periods = 4, 1.0, 3.0, 5
  comm_seconds = [comm_s if (t + 1) % h == 0 else 0.0 for t in range(h * periods)]
  blocking = sim.simulate(compute, comm_seconds)
  eager = sim.simulate(compute, comm_seconds, overlap_steps=h)
  assert blocking.total == h * periods * compute + periods * comm_s
  assert eager.total == h * periods * compute + comm_s
  from experiments import methods  # the method module tells the clock its overlap
  settings = methods.method_defaults("diloco")
  settings.eager = True
  assert methods.load_method("diloco").overlap_steps(settings) == settings.sync_every


# ------------------------------------------------------------------ per-replica periods
STEPS = [2, 2, 2, 2, 1, 1, 1, 1]  # workers 4..7 are half as fast: 1 of every 2 steps
TOKENS = [1, 1, 1, 1, 3, 3, 3, 3]  # ... with 3x the tokens per step


def test_per_replica_periods_token_weighted_match_reference(task):
  params, loss, batches, _ = task
  h, steps = 2, 4
  outer = optax.sgd(0.7, momentum=0.9)
  tx = local.diloco(optax.sgd(LR), outer, h, worker_steps=STEPS, weighting="tokens",
                    tokens_per_step=TOKENS)
  trainer, state, sent = run_trainer(loss, tx, params, batches, steps)
  uniform = local.diloco(optax.sgd(LR), outer, h, worker_steps=STEPS)
  _, state_u, _ = run_trainer(loss, uniform, params, batches, steps)

  def reference(weights):
    theta, o, ps = params, outer.init(params), stack(params)
    for t in range(1, steps + 1):
      moved = sgd_steps(task, ps, t)
      busy = np.asarray([(t - 1) % h < s for s in STEPS])
      ps = jax.tree.map(lambda a, b: jnp.where(busy.reshape(-1, *[1] * (a.ndim - 1)), a, b),
                        moved, ps)
      if t % h == 0:
        delta = wmean(jax.tree.map(jnp.subtract, stack(theta), ps), weights)
        step, o = outer.update(delta, o, theta)
        theta = optax.apply_updates(theta, step)
        ps = stack(theta)
    return ps

  close(state.params, reference(np.multiply(STEPS, TOKENS)))  # tokens: H_r x tokens/step
  close(state_u.params, reference(None))
  assert not np.allclose(jax.tree.leaves(state.params)[1], jax.tree.leaves(state_u.params)[1])
  assert sent == [0, ALLREDUCE] * 2
  assert inspect(trainer, state, batches[0]).wire_bytes(conditional=True) == ALLREDUCE


def test_per_replica_periods_on_the_heterogeneous_clock():
  """Workers 4..7 take 2 s a step, the others 1 s: with one H = 8 every round waits 16 s for
  the slow ones; with H_r = 8 and 4 the round takes 8 s and every worker is busy."""
  times = sim.fixed([1.0] * 4 + [2.0] * 4)
  key = jax.random.key(0)
  same = sim.round_seconds(times, key, [8] * 8, 3, comm_seconds=1.0)
  per_replica = sim.round_seconds(times, key, [8] * 4 + [4] * 4, 3, comm_seconds=1.0)
  np.testing.assert_array_equal(same, [17.0] * 3)
  np.testing.assert_array_equal(per_replica, [9.0] * 3)
  with pytest.raises(ValueError, match="worker_steps"):
    sim.round_seconds(times, key, [0] * 8, 3)


@pytest.mark.parametrize("kwargs,words", [
    (dict(worker_steps=[1, 3]), "worker_steps"),
    (dict(worker_steps="2"), "worker_steps"),
    (dict(weighting="flops"), "weighting"),
    (dict(tokens_per_step=[1, 0]), "tokens_per_step"),
    (dict(worker_steps=[1, 2], tokens_per_step=[1, 1, 1]), "tokens_per_step"),
    (dict(eager="yes"), "eager"),
])
def test_diloco_new_options_fail_when_built(kwargs, words):
  with pytest.raises(ValueError, match=words):
    local.diloco(optax.sgd(0.1), optax.sgd(1.0), 2, **kwargs)


def test_noloco_bad_input():
  for kw, words in ((dict(outer_lr=0.0), "outer_lr"), (dict(momentum=1.0), "momentum"),
                    (dict(gamma=-1.0), "gamma"), (dict(matchings=0), "matchings")):
    with pytest.raises(ValueError, match=words):
      local.noloco(optax.sgd(0.1), 2, **kw)
