"""The event loops of `simulate_failures` (jaxcomm/sim/_goodput.py has the semantics).

Each returns the breakpoints (wall seconds, progress in failure-free seconds) of one run and
the number of failures that hit it; progress drops where work is lost.
"""

from __future__ import annotations

import heapq
import math

from jaxcomm import elastic
from jaxcomm.sim._failures import expected_slowdown, interval


class Clock:
  """When each unit fails next: drawn (a Poisson process of `rate` per unit while it is up)
  or read from a fixed schedule of (seconds, unit) (a failure while the unit is down does
  not happen)."""

  def __init__(self, rate: float, rng, schedule=None):
    self.rate, self.rng = rate, rng
    self.schedule = None
    if schedule is not None:
      self.schedule = {}
      for when, unit in sorted(schedule):
        self.schedule.setdefault(int(unit), []).append(float(when))

  def after(self, unit: int, t: float) -> float:
    """The next failure of `unit`, up from time t on."""
    if self.schedule is not None:
      times = self.schedule.get(unit, [])
      while times and times[0] < t:
        times.pop(0)
      return times.pop(0) if times else math.inf
    return t + self.rng.exponential(1.0 / self.rate) if self.rate else math.inf


def restart_run(model, devices, sem, step_s, work_s, horizon_s, clock):
  """Checkpoint/restart: segments of `interval` work, each followed by a save."""
  del sem, step_s
  slow = expected_slowdown(model, devices)
  every = interval(model, devices)
  t, done, failures = 0.0, 0.0, 0
  wall, prog = [0.0], [0.0]
  fail = clock.after(0, 0.0)
  while done < work_s and t < horizon_s:
    seg = min(every, work_s - done, (horizon_s - t) / slow)
    save = model.checkpoint_s if done + seg < work_s and t + seg * slow < horizon_s else 0.0
    if fail >= t + seg * slow + save:   # the segment and its save complete
      t += seg * slow
      done += seg
      wall.append(t), prog.append(done)
      if save:
        t += save
        wall.append(t), prog.append(done)
      continue
    failures += 1
    reached = done + min(fail - t, seg * slow) / slow
    wall.extend((fail, fail)), prog.extend((reached, done))
    t = fail
    while True:   # down (not exposed), then the restore (exposed: may fail again)
      t += model.detect_s + model.restart_s
      fail = clock.after(0, t)
      wall.append(t), prog.append(done)
      if fail >= t + model.restore_s:
        t += model.restore_s
        wall.append(t), prog.append(done)
        break
      failures += 1
      t = fail
      wall.append(t), prog.append(done)
  return wall, prog, failures


def quorum_ok(quorum: elastic.Quorum, live: int, kept: int, last: int, step: int) -> bool:
  """`quorum.violations(...) == []` from counts: `live` processes, `kept` of them in the last
  quorum of `last` (the rule of `jaxcomm.elastic.Quorum`, in O(1) for large runs)."""
  return live >= quorum.minimum(step) and not (quorum.majority and last
                                               and not 2 * kept > last)


class _Replicas:
  """Who is live, back (waiting for a round boundary) or down; the last quorum's overlap."""

  def __init__(self, k):
    self.state = ["live"] * k
    self.live, self.ready = k, set()
    self.last, self.gone, self.new = k, set(), set()  # last quorum's size; left it; joined

  def fail(self, u) -> bool:
    """Replica u goes down; whether it was live."""
    was, self.state[u] = self.state[u], "down"
    self.ready.discard(u)
    if was == "live":
      self.live -= 1
      if u in self.new:
        self.new.discard(u)
      else:
        self.gone.add(u)
    return was == "live"

  def join(self):
    for u in self.ready:
      self.state[u] = "live"
      if u in self.gone:
        self.gone.discard(u)
      else:
        self.new.add(u)
    self.live += len(self.ready)
    self.ready = set()

  def commit(self):
    self.last, self.gone, self.new = self.live, set(), set()

  def valid(self, quorum, step, joining=False) -> bool:
    live = self.live + (len(self.ready) if joining else 0)
    kept = self.last - len(self.gone - self.ready if joining else self.gone)
    return quorum_ok(quorum, live, kept, self.last, step)


def elastic_run(model, devices, sem, step_s, work_s, horizon_s, clock):
  """Rounds over the live replicas under the runtime's quorum rules, event by event."""
  k = sem.units
  round_s = sem.round_steps * step_s * expected_slowdown(model, max(1, round(devices / k)))
  fail_at = [clock.after(u, 0.0) for u in range(k)]  # next failure of each replica while up
  fails = [(f, u) for u, f in enumerate(fail_at)]
  heapq.heapify(fails)
  backs = []                                    # (when, replica) of the replicas down
  reps = _Replicas(k)
  t, done, failures, steps = 0.0, 0.0, 0, 0
  start = 0.0                                   # when the round in flight began (None: waiting)
  wall, prog = [0.0], [0.0]
  while done < work_s and t < horizon_s:
    while fails and fails[0][0] != fail_at[fails[0][1]]:  # (replicas that went down since)
      heapq.heappop(fails)
    tf, uf = fails[0] if fails else (math.inf, -1)
    tb = backs[0][0] if backs else math.inf
    if start is not None:   # whole rounds that end before the next event commit
      share = reps.live / k
      until = min(tf, tb, horizon_s)
      finish = start + (work_s - done) / share
      if finish <= until:   # the run's last (partial) round
        t, done = finish, work_s
        wall.append(t), prog.append(done)
        break
      n = min((until - start) // round_s, 1 if reps.ready else math.inf)
      if n >= 1:
        t, done = start + n * round_s, done + n * round_s * share
        steps += int(n) * sem.round_steps
        reps.commit()
        wall.append(t), prog.append(done)
        start = t
        if reps.ready:   # replicas back since: they join at this boundary, after the window
          t += sem.quorum.join_window_s + model.regroup_s
          reps.join()
          start = t
          wall.append(t), prog.append(done)
        continue
    if min(tf, tb) >= horizon_s:
      t = horizon_s   # (a round in flight at the horizon is not counted)
      wall.append(t), prog.append(done)
      break
    if tb <= tf:   # a replica is back: it joins at the next round boundary
      event, u = heapq.heappop(backs)
      reps.state[u] = "ready"
      reps.ready.add(u)
      fail_at[u] = clock.after(u, tb)
      heapq.heappush(fails, (fail_at[u], u))
    else:
      event = tf
      failures += 1
      fail_at[uf] = math.inf
      heapq.heappush(backs, (tf + model.restart_s, uf))
      if reps.fail(uf) and start is not None:   # the round in flight is discarded
        wall.extend((tf, tf)), prog.extend((done + (tf - start) * (reps.live + 1) / k, done))
        t = tf + model.detect_s + model.regroup_s
        wall.append(t), prog.append(done)
        start = t if reps.valid(sem.quorum, steps) else None
    if start is None:   # below quorum: waits until the replicas back make a valid one
      t = max(t, event)
      if reps.live + len(reps.ready) and reps.valid(sem.quorum, steps, joining=True):
        reps.join()
        wall.append(t), prog.append(done)
        t += sem.quorum.join_window_s + model.regroup_s
        wall.append(t), prog.append(done)
        start = t
  return wall, prog, failures


def decoupled_run(model, devices, sem, step_s, work_s, horizon_s, clock):
  """Independent learners; a failure loses the learner's undelivered work."""
  m = sem.units
  slow = expected_slowdown(model, max(1, round(devices / m)))
  rate = 1.0 / (m * slow)   # progress per learner-second
  every = sem.round_steps * step_s * slow   # wall seconds between a learner's deliveries
  events = [(clock.after(u, 0.0), u, "fail") for u in range(m)]
  heapq.heapify(events)
  up_since = [0.0] * m
  up, t, done, failures = m, 0.0, 0.0, 0
  wall, prog = [0.0], [0.0]
  while done < work_s and t < horizon_s:
    when, u, kind = events[0] if events else (math.inf, -1, "")
    slope = up * rate
    until = min(when, horizon_s, t + (work_s - done) / slope if slope else math.inf)
    if until < when:   # the run ends first
      done += (until - t) * slope
      t = until
      wall.append(t), prog.append(done)
      break
    heapq.heappop(events)
    done += (when - t) * slope
    t = when
    if kind == "fail":
      failures += 1
      lost = ((t - up_since[u]) % every) * rate
      wall.extend((t, t)), prog.extend((done, done - lost))
      done -= lost
      up -= 1
      heapq.heappush(events, (t + model.restart_s, u, "back"))
    else:
      up += 1
      up_since[u] = t
      wall.append(t), prog.append(done)
      heapq.heappush(events, (clock.after(u, t), u, "fail"))
  return wall, prog, failures
