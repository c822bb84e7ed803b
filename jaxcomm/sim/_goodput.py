"""Goodput under failures: what each method's run does when a device fails, on the clock.

A run's progress is counted in its own failure-free seconds (its clock without failures, e.g.
`Timeline.known`), so goodput = progress / wall time is 1 without failures, and the time to
a target under failures is the wall time at which progress first reaches the failure-free
time to that target. Three failure semantics (`Semantics.kind`, declared by each method
module):

* `restart` (synchronous methods: DP, compression, ZeRO; the default): any failure stops
  the job, which loses the work since its last save, is down for detection + restart, then
  restores (exposed to failures) and goes on; it saves every `interval(model, N)` seconds of
  work, stopping `checkpoint_s` each time.
* `elastic` (`jaxcomm.elastic`'s rules; DiLoCo, Streaming DiLoCo): `units` replicas work in
  rounds of `round_steps` steps. A failure discards the round in flight on every survivor
  (no partial update is applied), costs `detect_s`, and the next round runs without the
  failed replica if the quorum allows (`elastic.Quorum`: `min_workers`, majority of the last
  quorum), else everyone waits for it. A replica back after `restart_s` joins at the next
  round boundary, after the join window. A round with L of K replicas makes L / K of a
  round's progress (its batch is L / K of the full one).
* `decoupled` (Decoupled DiLoCo): `units` learners never wait for each other. A failure
  loses the failed learner's work since its last fragment delivery (every `round_steps`
  steps); it is back after `restart_s` and goes on from the syncer's fragments. The syncer's
  quorum delays merges, never the learners, so it does not enter goodput here.

Stragglers slow each step by the expected maximum over the devices that step in lockstep
(`expected_slowdown`): the job's for `restart`, a replica's for `elastic` (whose rounds then
wait for the slowest replica: for long rounds close to the same figure), a learner's for
`decoupled`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from jaxcomm import _validate as v
from jaxcomm import elastic
from jaxcomm.sim import _events
from jaxcomm.sim._failures import FailureModel, checkpoint_goodput, expected_slowdown

KINDS = ("restart", "elastic", "decoupled")


class Semantics(NamedTuple):
  """How a method's run behaves when a device fails (a method module's declaration).

  >>> Semantics("elastic", units=4, round_steps=10).check(devices=16).units
  4
  """
  kind: str = "restart"
  units: int = 1             # elastic: replicas; decoupled: learners (failure domains)
  round_steps: int = 1       # elastic: steps per round; decoupled: steps between deliveries
  quorum: elastic.Quorum = elastic.Quorum()  # elastic: the runtime's quorum rules

  def check(self, devices: int) -> "Semantics":
    """Self with checked settings for a run of `devices` devices (ValueError naming one)."""
    v.one_of("semantics", self.kind, KINDS)
    units = v.integer("units", self.units, low=1, high=devices)
    v.integer("round_steps", self.round_steps, low=1)
    v.instance("quorum", self.quorum, elastic.Quorum, "jaxcomm.elastic.Quorum")
    self.quorum.check()
    if not callable(self.quorum.min_workers) and self.quorum.min_workers > units:
      raise ValueError(f"min_workers ({self.quorum.min_workers}) must be <= units ({units}): "
                       f"a quorum larger than the replicas never forms.")
    return self._replace(units=units)


class FailureRun(NamedTuple):
  """Progress against wall time of one simulated run (breakpoints of a piecewise-linear
  curve; progress drops where work is lost)."""
  wall: np.ndarray       # f64[K]: seconds
  progress: np.ndarray   # f64[K]: failure-free seconds done (lost work taken off)
  failures: int          # failures that hit the run (a unit that was up)

  @property
  def goodput(self) -> float:
    """Progress kept at the end over the wall time."""
    return float(self.progress[-1] / self.wall[-1]) if self.wall[-1] > 0 else 1.0

  def time_to(self, work) -> np.ndarray:
    """Wall seconds at which progress first reaches each of `work` (inf if never)."""
    work = np.atleast_1d(np.asarray(work, np.float64))
    env = np.maximum.accumulate(self.progress)
    i = np.searchsorted(env, work, side="left")
    out = np.full(work.shape, np.inf)
    ok = i < len(env)
    j = np.clip(i, 1, len(env) - 1)
    p0, p1 = self.progress[j - 1], self.progress[j]
    t0, t1 = self.wall[j - 1], self.wall[j]
    frac = np.where(p1 > p0, (work - p0) / np.where(p1 > p0, p1 - p0, 1.0), 1.0)
    out[ok] = np.where(i[ok] == 0, self.wall[0], t0[ok] + np.clip(frac[ok], 0, 1)
                       * (t1[ok] - t0[ok]))
    return out


def simulate_failures(model: FailureModel, devices: int, semantics: Semantics, step_s: float,
                      *, work_s: float = math.inf, horizon_s: float = math.inf,
                      seed: int = 0, failures=None) -> FailureRun:
  """One seeded run under `model`, event by event, until `work_s` of progress or `horizon_s`.

  Args:
    model: the failure model (`failure_model`).
    devices: N, the run's devices.
    semantics: the method's failure semantics (`Semantics`).
    step_s: failure-free seconds per step (sets rounds and delivery intervals).
    work_s: stop once this much progress (failure-free seconds) is kept.
    horizon_s: stop at this wall time (one of the two must be finite).
    seed: the failure draws' seed.
    failures: optional fixed schedule, (seconds, unit) pairs (e.g. `draw_failures`' or a
      real run's), instead of draws; a failure of a unit that is down is skipped.

  >>> from jaxcomm.sim import failure_model
  >>> run = simulate_failures(failure_model("none"), 8, Semantics(), 1.0, work_s=100.0)
  >>> run.goodput, float(run.time_to(50.0)[0])
  (1.0, 50.0)
  """
  devices = v.integer("devices", devices, low=1)
  sem = semantics.check(devices)
  step_s = v.number("step_s", step_s, low=0.0, low_open=True)
  if math.isinf(work_s) and math.isinf(horizon_s):
    raise ValueError("simulate_failures needs a finite work_s or horizon_s.")
  rng = np.random.default_rng(v.integer("seed", seed, low=0))
  units = 1 if sem.kind == "restart" else sem.units   # (a synchronous job fails as one)
  if failures is not None and units == 1:
    failures = [(when, 0) for when, _ in failures]
  clock = _events.Clock(model.rate * devices / units, rng, failures)
  fn = {"restart": _events.restart_run, "elastic": _events.elastic_run,
        "decoupled": _events.decoupled_run}[sem.kind]
  wall, progress, hit = fn(model, devices, sem, step_s, work_s, horizon_s, clock)
  return FailureRun(np.asarray(wall, np.float64), np.asarray(progress, np.float64), hit)


def expected_goodput(model: FailureModel, devices: int, semantics: Semantics,
                     step_s: float) -> float:
  """Goodput to first order in the failure rate (exact for `restart`: `checkpoint_goodput`).

  elastic: each replica is up a fraction 1 / (1 + lambda_r (R + round / 2 + join window));
  every failure costs each survivor half a round and the detection. decoupled: each learner
  is up 1 / (1 + lambda_l R) and a failure loses half a delivery interval of its work.

  >>> from jaxcomm.sim import failure_model
  >>> expected_goodput(failure_model("none"), 64, Semantics("decoupled", 8, 10), 1.0)
  1.0
  """
  devices = v.integer("devices", devices, low=1)
  sem = semantics.check(devices)
  if sem.kind == "restart":
    return checkpoint_goodput(model, devices, slowdown=expected_slowdown(model, devices))
  per_unit = devices / sem.units
  lam = model.rate * per_unit
  slow = expected_slowdown(model, max(1, round(per_unit)))
  round_s = sem.round_steps * step_s * slow
  if sem.kind == "decoupled":
    up = 1.0 / (1.0 + lam * model.restart_s)
    return up * (1.0 - lam * round_s / 2.0) / slow
  up = 1.0 / (1.0 + lam * (model.restart_s + round_s / 2.0 + sem.quorum.join_window_s))
  lost = lam * sem.units * (round_s / 2.0 + model.detect_s)
  return max(0.0, up * (1.0 - lost)) / slow
