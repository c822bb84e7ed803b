"""Heterogeneous workers: Rennala against an event-driven reference, the simulated-time claims."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm import sim

W = 8
D = 12
SCALES = jnp.linspace(0.5, 2.0, D)


def loss_fn(p):
  return 0.5 * jnp.sum(SCALES * p["x"] ** 2)


def grad_fn(p, key):  # a noisy gradient of loss_fn: one sample per key
  return {"x": SCALES * p["x"] + jax.random.normal(key, (D,))}


PARAMS = {"x": jnp.full((D,), 3.0)}


def rennala_reference(compute, batch, steps, lr, seed=0):
  """Event-driven Rennala SGD on one device: a heap of (finish time, worker, job, iterate).

  Jobs finishing at the same time are handled in (worker, job) order; workers freed at time
  t start their next job after every event at t, on the iterate current then. Every job
  carries the iterate it started on; a result is used only if that is the current iterate,
  else discarded. The SPMD run must use exactly the same (worker, job) gradients.
  """
  time_key, grad_key = jax.random.split(jax.random.PRNGKey(seed))
  times = compute.table(time_key, W, batch * steps + 4 * steps + 8).astype(np.float64)
  grad = jax.jit(lambda x, w, j: grad_fn(
      {"x": x}, jax.random.fold_in(jax.random.fold_in(grad_key, w), j))["x"])
  x, k, collected = np.asarray(PARAMS["x"], np.float32), 0, []
  next_job = [1] * W
  heap = [(times[w, 0], w, 0, 0) for w in range(W)]
  heapq.heapify(heap)
  clock, used, discarded = [], [], []
  stale_now = 0
  while k < steps:
    t = heap[0][0]
    freed = []
    while heap and heap[0][0] == t:
      _, w, j, started = heapq.heappop(heap)
      freed.append(w)
      if started != k:  # computed at an iterate that has been replaced: thrown away
        stale_now += 1
        continue
      collected.append((w, j))
      if len(collected) == batch:
        total = sum(np.asarray(grad(x, w_, j_)) for w_, j_ in collected)
        x = x - np.float32(lr / batch) * total
        clock.append(t)
        used.append(np.bincount([w_ for w_, _ in collected], minlength=W))
        discarded.append(stale_now)
        k, collected, stale_now = k + 1, [], 0
        if k == steps:
          break
    for w in freed:
      heapq.heappush(heap, (t + times[w, next_job[w]], w, next_job[w], k))
      next_job[w] += 1
  return np.array(clock), np.array(used), x


@pytest.fixture(scope="module")
def one_slow_worker(mesh8):
  compute = sim.fixed([1.0] * 7 + [10.0])
  runs = {m.kind: sim.simulate_workers(m, grad_fn, loss_fn, PARAMS, compute, mesh=mesh8, steps=60,
                               lr=0.2)
          for m in (sim.synchronous_sgd(), sim.rennala_sgd(W))}
  return compute, runs


def test_rennala_equals_event_driven_reference_and_never_uses_stale_gradients(
    mesh8, one_slow_worker):
  compute, runs = one_slow_worker
  for compute, result in ((compute, runs["rennala"]),
                          (sim.lognormal(np.linspace(0.5, 3.0, W), 0.7),
                           sim.simulate_workers(sim.rennala_sgd(5), grad_fn, loss_fn, PARAMS,
                                        sim.lognormal(np.linspace(0.5, 3.0, W), 0.7),
                                        mesh=mesh8, steps=25, lr=0.2))):
    batch = int(result.used[0].sum())
    clock, used, x = rennala_reference(compute, batch, len(result.used), 0.2)
    np.testing.assert_allclose(result.time[1:], clock, rtol=1e-5)
    np.testing.assert_array_equal(result.used, used)  # the same fresh gradients, step by step
    np.testing.assert_allclose(result.params["x"], x, rtol=1e-4, atol=1e-5)
    assert result.discarded.sum() > 0  # stale work existed and was thrown away, not used
  # The slow worker never finishes within a step: every one of its gradients is stale.
  assert runs["rennala"].used[:, -1].sum() == 0


def asynchronous_reference(compute, steps, lr, seed=0):
  """Asynchronous SGD on one device: the first gradient to arrive (ties: the lower worker)
  is applied at once; its worker restarts from the new iterate with its next job."""
  time_key, grad_key = jax.random.split(jax.random.PRNGKey(seed))
  times = compute.table(time_key, W, steps + 2).astype(np.float64)
  grad = jax.jit(lambda x, w, j: grad_fn(
      {"x": x}, jax.random.fold_in(jax.random.fold_in(grad_key, w), j))["x"])
  x = np.asarray(PARAMS["x"], np.float32)
  snapshot, start, job = [x] * W, [0] * W, [0] * W
  busy = [times[w, 0] for w in range(W)]
  clock, staleness = [], []
  for k in range(steps):
    w = int(np.argmin(busy))
    clock.append(busy[w])
    staleness.append(k - start[w])
    x = x - np.float32(lr) * np.asarray(grad(snapshot[w], w, job[w]))
    snapshot[w], start[w], job[w] = x, k + 1, job[w] + 1
    busy[w] += times[w, job[w]]
  return np.array(clock), np.array(staleness), x


def test_asynchronous_sgd_uses_stale_gradients_as_the_event_driven_reference(mesh8):
  compute = sim.fixed([1.0] * 7 + [10.0])
  result = sim.simulate_workers(sim.asynchronous_sgd(), grad_fn, loss_fn, PARAMS, compute,
                                mesh=mesh8, steps=80, lr=0.02)
  assert (result.used.sum(1) == 1).all()
  assert result.staleness.max() >= 7  # the slow worker's gradient arrives ~70 steps late
  clock, staleness, x = asynchronous_reference(compute, 80, 0.02)
  np.testing.assert_allclose(result.time[1:], clock, rtol=1e-6)
  np.testing.assert_array_equal(result.staleness, staleness)
  np.testing.assert_allclose(result.params["x"], x, rtol=1e-4, atol=1e-5)


def test_rennala_beats_synchronous_sgd_in_simulated_time_with_one_slow_worker(one_slow_worker):
  _, runs = one_slow_worker
  sync, rennala = runs["synchronous"], runs["rennala"]
  # Same batch per step: synchronous waits 10 per step, Rennala 2 (the fast workers' pace).
  np.testing.assert_allclose(np.diff(sync.time), 10.0)
  np.testing.assert_allclose(np.diff(rennala.time), 2.0)
  horizon = rennala.time[-1]
  assert rennala.loss_at(horizon) < 0.2 * sync.loss_at(horizon), (rennala.loss_at(horizon),
                                                                  sync.loss_at(horizon))
  target = 2 * rennala.loss[-10:].mean()
  assert rennala.time_to(target) < 0.5 * sync.time_to(target)


def test_mindflayer_beats_rennala_under_heavy_tailed_times(mesh8):
  compute = sim.heavy_tailed(base=1.0, scale=0.1, alpha=0.5)  # infinite mean: workers get stuck
  rennala = sim.simulate_workers(sim.rennala_sgd(W), grad_fn, loss_fn, PARAMS, compute, mesh=mesh8,
                         steps=60, lr=0.2, key=jax.random.key(3))
  mindflayer = sim.simulate_workers(sim.mindflayer_sgd(allotted=2.0, trials=1), grad_fn, loss_fn,
                            PARAMS, compute, mesh=mesh8, steps=60, lr=0.2, key=jax.random.key(3))
  assert mindflayer.time[-1] <= 60 * 2.0 + 1e-3  # a step never lasts more than the allotted time
  horizon = mindflayer.time[-1]
  assert mindflayer.loss_at(horizon) < 0.5 * rennala.loss_at(horizon), (
      mindflayer.loss_at(horizon), rennala.loss_at(horizon))
  # Measured at seed 3: loss 1.0 reached at t = 20 (MindFlayer) and t = 105 (Rennala).
  assert mindflayer.time_to(1.0) < 0.5 * rennala.time_to(1.0)
  assert mindflayer.discarded.sum() > 0  # attempts past the allotted time were restarted


def test_compute_models():
  key = jax.random.PRNGKey(0)
  table = sim.lognormal(2.0, 0.5).table(key, W, 1000)
  assert abs(np.median(table) - 2.0) < 0.1 and (table > 0).all()
  tail = sim.heavy_tailed(1.0, 1.0, 1.5).table(key, W, 1000) - 1.0
  # Lomax(1.5): P(extra > 3) = 4 ** -1.5 = 0.125.
  assert abs((tail > 3.0).mean() - 0.125) < 0.015
  again = sim.heavy_tailed(1.0, 1.0, 1.5).table(key, W, 1000) - 1.0
  np.testing.assert_array_equal(tail, again)  # a pure function of (key, worker, job)


def test_bad_input_fails_at_build(mesh8):
  for bad in (lambda: sim.fixed([1.0, -1.0]), lambda: sim.lognormal(-1.0, 0.5),
              lambda: sim.lognormal(1.0, -0.5), lambda: sim.heavy_tailed(-1.0, 1.0, 1.0),
              lambda: sim.heavy_tailed(1.0, -1.0, 1.0), lambda: sim.heavy_tailed(1.0, 1.0, 0.0)):
    with pytest.raises(ValueError, match="negative|> 0"):
      bad()
  with pytest.raises(ValueError, match="batch"):
    sim.rennala_sgd(0)
  with pytest.raises(ValueError, match="allotted"):
    sim.mindflayer_sgd(-1.0)
  with pytest.raises(ValueError, match="trials"):
    sim.mindflayer_sgd(1.0, trials=0)
  with pytest.raises(ValueError, match="describes 3 workers"):
    sim.simulate_workers(sim.synchronous_sgd(), grad_fn, loss_fn, PARAMS,
                         sim.fixed([1.0, 2.0, 3.0]), mesh=mesh8, steps=2, lr=0.1)
  with pytest.raises(ValueError, match="steps"):
    sim.simulate_workers(sim.synchronous_sgd(), grad_fn, loss_fn, PARAMS, sim.fixed(1.0),
                         mesh=mesh8, steps=0, lr=0.1)
