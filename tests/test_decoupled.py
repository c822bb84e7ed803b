"""Decoupled DiLoCo (jaxcomm.local.decoupled_diloco) on the simulated clock
(jaxcomm.sim.decoupled_schedule), on 4 learners of a 12-parameter linear model.

* Held against an event-driven numpy reference written here (a heap of step ends, grace
  timers, failures and returns; learners, syncer and the arithmetic in float32 numpy): the
  same merges at the same times with the same learners and token weights, and the same
  learner parameters and syncer fragments at the end, with heterogeneous step times,
  failures, a quorum of 2, a grace window and learners of different tokens per step.
* With every learner in every quorum, equal speeds and no failures it is Streaming DiLoCo:
  the same parameters, outer parameters and bytes.
* Bytes per merge: counted in state == `comm.inspect` of the compiled step == 2 (M-1)/M x
  the fragment's bytes (written out below).
"""

import heapq

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm import comm, local, sim, train

M, B, P, H = 4, 8, 2, 4
LR, MU, OUTER_LR, OUTER_MU = 0.05, 0.5, 0.7, 0.9
SIZES = {"a": 5, "b": 3, "c": 4}  # leaves in tree order: n = 12, two fragments of 6
TRUE = np.linspace(-1.0, 1.0, 12).astype(np.float32)


def loss(params, batch):
  theta = jnp.concatenate([params[k] for k in sorted(SIZES)])
  return jnp.mean((batch["x"] @ theta - batch["y"]) ** 2)


def data(learner, step):
  """Learner `learner`'s batch number `step` (each learner's data has its own optimum)."""
  rng = np.random.default_rng(1000 * learner + step)
  x = rng.normal(size=(B, 12)).astype(np.float32)
  return x, (x @ (TRUE + np.float32(0.2 * learner))).astype(np.float32)


PARAMS = {k: jnp.full((n,), 0.1 * (i + 1), jnp.float32) for i, (k, n) in
          enumerate(sorted(SIZES.items()))}


def transform(schedule, alpha):
  return local.decoupled_diloco(optax.sgd(LR, momentum=MU),
                                optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True),
                                schedule, fragments=P, alpha=alpha)


def run(tx, schedule=None, steps=None):
  """The Trainer over the schedule's ticks (or `steps` steps of every learner's batches);
  (state, the bytes each tick counted, trainer, one batch)."""
  trainer = train.Trainer(loss, tx, train.make_mesh({"data": M}, devices=jax.devices()[:M]))
  state = trainer.init(PARAMS)
  sent = []
  ticks = len(schedule.time) if schedule is not None else steps
  for i in range(ticks):
    rows = [data(m, int(schedule.step[i, m]) if schedule is not None else i)
            if schedule is None or schedule.step[i, m] >= 0 else
            (np.zeros((B, 12), np.float32), np.zeros(B, np.float32)) for m in range(M)]
    batch = {"x": np.concatenate([x for x, _ in rows]), "y": np.concatenate([y for _, y in rows])}
    state, metrics = trainer.step(state, batch)
    sent.append(int(metrics["wire_bytes"]))
  return state, sent, trainer, batch


# ------------------------------------------------------------------ the numpy reference
def deal(vec):
  return np.pad(vec, (0, (-len(vec)) % P)).reshape(-1, P).T.copy()


def undeal(mat, n=12):
  return mat.T.reshape(-1)[:n].copy()


class Reference:
  """Decoupled DiLoCo event by event (the rules of jaxcomm/sim/_decoupled.py's docstring)."""

  def __init__(self, times, quorum, grace, latency, failures, restart, alpha):
    self.times, self.quorum, self.grace, self.latency = times, quorum, grace, latency
    self.restart, self.alpha = restart, np.float32(alpha)
    theta0 = np.concatenate([np.asarray(PARAMS[k]) for k in sorted(SIZES)])
    self.theta = [theta0.copy() for _ in range(M)]
    self.mom = [np.zeros(12, np.float32) for _ in range(M)]
    self.outer, self.trace = deal(theta0), np.zeros((P, 6), np.float32)
    self.up, self.k, self.j = [True] * M, [0] * M, [0] * M
    self.since = [np.zeros(P) for _ in range(M)]
    self.inbox = [[[] for _ in range(P)] for _ in range(M)]
    self.epoch = [0] * M
    self.pending = [{} for _ in range(P)]   # fragment -> {learner: (values, tokens)}
    self.timer = [None] * P
    self.merges = []                        # (time, fragment, {learner: weight})
    self.queue = []
    for m in range(M):
      self.at(times[m][0], 0, m)
    for when, m in failures:
      self.at(when, 2, m)

  def at(self, when, kind, who):
    """Events: 0 a step ends, 1 a grace timer, 2 a failure, 3 a return."""
    heapq.heappush(self.queue, (when, kind, who, self.epoch[who] if kind == 0 else 0))

  def run(self, horizon):
    while self.queue and self.queue[0][0] <= horizon:
      now = self.queue[0][0]
      batch = []
      while self.queue and self.queue[0][0] == now:
        batch.append(heapq.heappop(self.queue))
      ends = sorted(w for _, kind, w, e in batch if kind == 0 and self.up[w]
                    and e == self.epoch[w])
      for m in ends:
        self.step(m, now)
      if ends or any(kind == 1 for _, kind, _, _ in batch):
        for p in range(P):
          self.maybe_merge(p, now, horizon)
      for m in ends:
        for p in range(P):
          arrived = [a for a in self.inbox[m][p] if a <= now]
          if arrived:
            self.inbox[m][p] = [a for a in self.inbox[m][p] if a > now]
            mat = deal(self.theta[m])
            mat[p] = self.alpha * mat[p] + (np.float32(1) - self.alpha) * self.outer[p]
            self.theta[m] = undeal(mat)
            self.since[m][p] = 0
      for _, kind, m, _ in batch:
        if kind == 2 and self.up[m]:
          self.up[m] = False
          self.epoch[m] += 1
          if now + self.restart <= horizon:
            self.at(now + self.restart, 3, m)
      for _, kind, m, _ in batch:
        if kind == 3:
          self.up[m], self.k[m] = True, 0
          self.since[m] = np.zeros(P)
          self.inbox[m] = [[] for _ in range(P)]
          self.theta[m] = undeal(self.outer)
          self.mom[m] = np.zeros(12, np.float32)
          self.at(now + self.times[m][self.j[m]], 0, m)

  def step(self, m, now):
    x, y = data(m, self.j[m])
    grad = (np.float32(2 / B) * (x.T @ (x @ self.theta[m] - y))).astype(np.float32)
    self.mom[m] = grad + np.float32(MU) * self.mom[m]
    self.theta[m] = self.theta[m] - np.float32(LR) * self.mom[m]
    self.j[m] += 1
    self.k[m] += 1
    self.since[m] += CLOCK["tokens_per_step"][m]
    for p in range(P):
      if self.k[m] % H == p * H // P:
        self.pending[p][m] = (deal(self.theta[m])[p], self.since[m][p])
    self.at(now + self.times[m][self.j[m]], 0, m)

  def maybe_merge(self, p, now, horizon):
    if len(self.pending[p]) < self.quorum:
      return
    if self.timer[p] is None:
      self.timer[p] = now + self.grace
      if self.timer[p] <= horizon:
        heapq.heappush(self.queue, (self.timer[p], 1, p, 0))
    everyone = all(m in self.pending[p] for m in range(M) if self.up[m])
    if now < self.timer[p] and not everyone:
      return
    w = {m: tokens for m, (_, tokens) in self.pending[p].items()}
    total = sum(w.values())
    delta = sum(np.float64(w[m]) * (self.outer[p] - values)
                for m, (values, _) in self.pending[p].items()) / total
    delta = delta.astype(np.float32)
    self.trace[p] = delta + np.float32(OUTER_MU) * self.trace[p]
    self.outer[p] = self.outer[p] - np.float32(OUTER_LR) * (
        delta + np.float32(OUTER_MU) * self.trace[p])
    self.merges.append((now, p, w))
    self.pending[p], self.timer[p] = {}, None
    for m in range(M):
      if self.up[m]:
        self.inbox[m][p].append(now + self.latency)


# ------------------------------------------------------------------ tests
CLOCK = dict(quorum=2, grace_s=0.5, latency_s=0.3, failures=[(5.2, 1), (9.0, 3)],
             restart_s=2.5, tokens_per_step=[1.0, 2.0, 1.0, 3.0])
TIMES = np.random.default_rng(0).uniform(0.5, 2.0, (M, 64))
HORIZON = 16.0


@pytest.fixture(scope="module")
def clocked():  # (one compile: the tests that read it are slow)
  schedule = sim.decoupled_schedule(TIMES, P, H, HORIZON, **CLOCK)
  state, sent, trainer, batch = run(transform(schedule, 0.5), schedule)
  return schedule, state, sent, trainer, batch


@pytest.mark.slow
def test_schedule_has_the_reference_event_order(clocked):
  schedule = clocked[0]
  ref = Reference(TIMES, CLOCK["quorum"], CLOCK["grace_s"], CLOCK["latency_s"],
                  CLOCK["failures"], CLOCK["restart_s"], 0.5)
  ref.run(HORIZON)
  got = [(float(schedule.time[i]), int(schedule.merge[i]),
          tuple(np.flatnonzero(schedule.weight[i]))) for i in np.flatnonzero(
              schedule.merge >= 0)]
  want = [(t, p, tuple(sorted(w))) for t, p, w in ref.merges]
  assert got == want
  assert len(want) >= 6 and {len(w) for _, _, w in want} >= {2, 3}  # quorum and grace both
  for i, (_, _, w) in zip(np.flatnonzero(schedule.merge >= 0), ref.merges):
    mean = np.mean(list(w.values()))
    np.testing.assert_allclose(schedule.weight[i][sorted(w)],
                               [w[m] / mean for m in sorted(w)], rtol=1e-6)
  # Failures: learner 1 is down from 5.2 to 7.7, learner 3 from 9.0 to 11.5.
  assert not schedule.busy[(schedule.time > 5.2) & (schedule.time < 7.7), 1].any()
  assert schedule.rejoin[:, 1].sum() == schedule.rejoin[:, 3].sum() == 1


@pytest.mark.slow
def test_parameters_equal_the_numpy_reference(clocked):
  schedule, state, _, _, _ = clocked
  ref = Reference(TIMES, CLOCK["quorum"], CLOCK["grace_s"], CLOCK["latency_s"],
                  CLOCK["failures"], CLOCK["restart_s"], 0.5)
  ref.run(HORIZON)
  got = np.concatenate([np.asarray(state.params[k]) for k in sorted(SIZES)], axis=1)
  np.testing.assert_allclose(got, np.stack(ref.theta), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state.opt_state.outer_params, ref.outer, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bytes_per_merge_counted_compiled_and_by_hand(clocked):
  schedule, state, sent, trainer, batch = clocked
  # One all-reduce of a 6-element float32 fragment over 4 learners: 2 x 3/4 x 24 bytes.
  per_merge = 36
  assert sent == [per_merge * (p >= 0) for p in schedule.merge.tolist()]
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  assert report.wire_bytes(conditional=True) == per_merge
  assert report.wire_bytes(conditional=False) == 0


@pytest.mark.slow
def test_every_learner_in_every_quorum_equal_speeds_no_failures_is_streaming_diloco():
  """Equal step times, quorum of all 4, no failures, the merge landing one step later
  (latency = one step): Streaming DiLoCo with P = 2, H = 4, tau = 1, alpha = 0.25."""
  steps = 12
  schedule = sim.decoupled_schedule(np.ones(M), P, H, float(steps), latency_s=1.0)
  assert len(schedule.time) == steps and schedule.busy.all()
  dec, dec_sent, _, _ = run(transform(schedule, 0.25), schedule)
  streaming = local.streaming_diloco(optax.sgd(LR, momentum=MU),
                                     optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True),
                                     H, fragments=P, overlap=1, alpha=0.25, codec=None)
  ref, ref_sent, _, _ = run(streaming, steps=steps)
  chex.assert_trees_all_equal(dec.params, ref.params)
  chex.assert_trees_all_equal(dec.opt_state.outer_params, ref.opt_state.outer_params)
  chex.assert_trees_all_equal(dec.opt_state.outer_state, ref.opt_state.outer_state)
  assert dec_sent == ref_sent and sum(dec_sent) > 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(quorum=5), "quorum \\(5\\) must be <= the learners \\(4\\)"),
    (dict(grace_s=-1.0), "grace_s must be a finite number in \\[0.0, inf\\)"),
    (dict(latency_s=-0.1), "latency_s must be"),
    (dict(restart_s=-2.0), "restart_s must be"),
    (dict(tokens_per_step=[1, 1]), "tokens_per_step must be 4 numbers"),
])
def test_bad_clock_settings_name_the_setting(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sim.decoupled_schedule(np.ones(M), P, H, 8.0, **kwargs)


@pytest.mark.slow
def test_bad_transform_settings_name_the_setting():
  schedule = sim.decoupled_schedule(np.ones(M), P, H, 8.0)
  with pytest.raises(ValueError, match="schedule.receive must be bool\\[8, 4, fragments=3\\]"):
    local.decoupled_diloco(optax.sgd(0.1), optax.sgd(1.0), schedule, fragments=3)
  with pytest.raises(ValueError, match="alpha must be"):
    local.decoupled_diloco(optax.sgd(0.1), optax.sgd(1.0), schedule, fragments=P, alpha=2.0)
  with pytest.raises(ValueError, match="schedule must be"):
    local.decoupled_diloco(optax.sgd(0.1), optax.sgd(1.0), schedule.busy, fragments=P)
  with pytest.raises(ValueError, match="schedule has 4 workers per sync, but axis_name"):
    trainer = train.Trainer(loss, transform(schedule, 0.0), train.make_mesh({"data": 8}))
    trainer.init(PARAMS)
