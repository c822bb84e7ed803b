"""Decoupled DiLoCo on the simulated clock: when each learner steps, delivers, receives.

Learners run at their own speeds (`step_seconds`) and never wait. Learner m delivers fragment
p to the syncer after its k-th step since it (re)started when k mod H = p·H // P (Streaming
DiLoCo's phases, on the learner's own count); the delivery carries its token weight, the
tokens it processed since it last took fragment p, and replaces an earlier delivery of p not
yet merged. The syncer merges fragment p once `quorum` learners have delivered it and then
either the grace window has passed since the quorum formed or every live learner has
delivered it. The merged fragment reaches the live learners `latency_s` later; each takes
the syncer's current fragment at the end of its first step after that. A learner that fails
loses the step in flight and is back after `restart_s`, from the syncer's fragments.

Events at the same instant, in this order: step ends (learners in index order; their
deliveries), the syncer's merges (fragments in index order), receipts of the learners whose
step just ended, failures, rejoins. Merge checks run only at instants with a step end or a
grace timer. Each instant becomes one tick per merge (at least one) of the
`jaxcomm.local.DecoupledSchedule`; receipts and rejoins go into its last tick.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from jaxcomm import _validate as v
from jaxcomm import local

_END, _TIMER, _FAIL, _BACK = range(4)


def decoupled_schedule(step_seconds, fragments: int, sync_every: int, horizon_s: float, *,
                       quorum: int | None = None, grace_s: float = 0.0,
                       latency_s: float = 0.0, failures: Sequence = (), restart_s: float = 0.0,
                       tokens_per_step=None) -> local.DecoupledSchedule:
  """The ticks of a Decoupled DiLoCo run of M learners up to `horizon_s` (module docstring).

  Args:
    step_seconds: f[M] (each learner's step time) or f[M, J] (its j-th step's).
    fragments: P fragments, 1 <= P <= H.
    sync_every: H, a learner's steps between two deliveries of the same fragment.
    horizon_s: simulated seconds to run.
    quorum: learners that must have delivered a fragment before it may merge (default M).
    grace_s: seconds the syncer waits for more deliveries once the quorum has formed.
    latency_s: seconds from a merge until the learners may take the fragment.
    failures: (seconds, learner) pairs, e.g. `draw_failures(...)`; a learner already down
      does not fail again.
    restart_s: seconds a failed learner is down.
    tokens_per_step: tokens of one step of each learner (default 1 each).

  Returns:
    A `jaxcomm.local.DecoupledSchedule`.

  >>> s = decoupled_schedule([1.0, 2.0], fragments=1, sync_every=2, horizon_s=4.0, quorum=1)
  >>> s.time.tolist(), s.merge.tolist()   # learner 0 delivers at t = 2 and 4, learner 1 at 4
  ([1.0, 2.0, 3.0, 4.0], [-1, 0, -1, 0])
  >>> [round(float(w), 3) for w in s.weight[3]]  # at 4: 2 steps and 1 since they took it
  [1.333, 0.667]
  """
  times = np.asarray(step_seconds, np.float64)
  if times.ndim == 1:
    times = times[:, None]
  if times.ndim != 2 or times.size == 0 or not np.all(np.isfinite(times)) or np.any(times <= 0):
    raise ValueError("step_seconds must be f[learners] or f[learners, steps] of finite "
                     "seconds > 0.")
  m = times.shape[0]
  h = v.integer("sync_every", sync_every, low=1)
  p_count = v.integer("fragments", fragments, low=1, high=h)
  horizon_s = v.number("horizon_s", horizon_s, low=0.0)
  quorum = m if quorum is None else v.integer("quorum", quorum, low=1)
  if quorum > m:
    raise ValueError(f"quorum ({quorum}) must be <= the learners ({m}).")
  grace_s = v.number("grace_s", grace_s, low=0.0)
  latency_s = v.number("latency_s", latency_s, low=0.0)
  restart_s = v.number("restart_s", restart_s, low=0.0)
  tokens = np.ones(m) if tokens_per_step is None else np.asarray(tokens_per_step, np.float64)
  if tokens.shape != (m,) or np.any(tokens <= 0):
    raise ValueError(f"tokens_per_step must be {m} numbers > 0, one per learner.")
  slots = np.full(h, -1)
  slots[[p * h // p_count for p in range(p_count)]] = range(p_count)

  up, count, done = [True] * m, [0] * m, [0] * m   # up; steps since (re)start; steps in all
  token = [0] * m                                  # invalidates a cancelled step's end
  since = np.zeros((m, p_count))                   # tokens since the learner took fragment p
  pending = [dict() for _ in range(p_count)]       # fragment -> {learner: weight}
  deadline = [None] * p_count
  arrivals = [[[] for _ in range(p_count)] for _ in range(m)]
  heap, seq = [], 0

  def push(when, kind, who, tag=0):
    nonlocal seq
    if when <= horizon_s:
      heapq.heappush(heap, (when, kind, who, tag, seq))
      seq += 1

  def next_step(u, now):
    if done[u] >= times.shape[1] and times.shape[1] > 1:
      raise ValueError(f"step_seconds has {times.shape[1]} steps per learner; learner {u} "
                       f"needs more before horizon_s = {horizon_s}.")
    push(now + times[u, min(done[u], times.shape[1] - 1)], _END, u, token[u])

  for u in range(m):
    next_step(u, 0.0)
  for when, u in failures:
    push(float(when), _FAIL, v.integer("failures' learner", int(u), low=0, high=m - 1))
  ticks = []
  while heap:
    now = heap[0][0]
    events = []
    while heap and heap[0][0] == now:
      events.append(heapq.heappop(heap))
    ends = sorted(u for _, k, u, tag, _ in events if k == _END and up[u] and tag == token[u])
    timed = any(k == _TIMER for _, k, _, _, _ in events)
    tick = _Tick(now, m, p_count)
    for u in ends:   # step ends and deliveries
      tick.busy[u], tick.step[u] = True, done[u]
      count[u] += 1
      done[u] += 1
      since[u] += tokens[u]
      p = slots[count[u] % h]
      if p >= 0:
        tick.deliver[u] = p
        pending[p][u] = since[u, p]
      next_step(u, now)
    merges = []
    for p in range(p_count) if ends or timed else ():   # the syncer
      if len(pending[p]) >= quorum and deadline[p] is None:
        deadline[p] = now + grace_s
        push(deadline[p], _TIMER, p)
      if len(pending[p]) >= quorum and (now >= deadline[p] or all(
          u in pending[p] for u in range(m) if up[u])):
        w = np.zeros(m)
        w[list(pending[p])] = list(pending[p].values())
        merges.append((p, w / w[w > 0].mean()))
        pending[p], deadline[p] = {}, None
        for u in range(m):
          if up[u]:
            arrivals[u][p].append(now + latency_s)
    for u in ends:   # receipts
      for p in range(p_count):
        if arrivals[u][p] and min(arrivals[u][p]) <= now:
          arrivals[u][p] = [a for a in arrivals[u][p] if a > now]
          tick.receive[u, p] = True
          since[u, p] = 0.0
    for _, k, u, _, _ in events:
      if k == _FAIL and up[u]:
        up[u] = False
        token[u] += 1
        push(now + restart_s, _BACK, u)
    for _, k, u, _, _ in events:
      if k == _BACK:
        up[u], count[u] = True, 0
        since[u] = 0.0
        arrivals[u] = [[] for _ in range(p_count)]
        tick.rejoin[u] = True
        next_step(u, now)
    ticks += tick.split(merges)
  if not ticks:
    raise ValueError(f"horizon_s = {horizon_s} ends before any learner's first step.")
  return local.DecoupledSchedule(*(np.stack(x) for x in zip(*ticks)))


class _Tick:
  """One instant's entries, split into one tick per merge."""

  def __init__(self, now, m, p_count):
    self.now = now
    self.busy, self.rejoin = np.zeros(m, bool), np.zeros(m, bool)
    self.deliver, self.step = np.full(m, -1, np.int32), np.full(m, -1, np.int32)
    self.receive = np.zeros((m, p_count), bool)

  def split(self, merges):
    if not (self.busy.any() or merges or self.receive.any() or self.rejoin.any()):
      return []
    m = len(self.busy)
    rows = []
    for i, (p, w) in enumerate(merges or [(-1, np.zeros(m))]):
      first, last = i == 0, i == max(len(merges), 1) - 1
      none = np.zeros(m, bool)
      rows.append((self.busy if first else none,
                   self.deliver if first else np.full(m, -1, np.int32), np.int32(p),
                   np.asarray(w, np.float32), self.receive if last else np.zeros_like(
                       self.receive), self.rejoin if last else none, np.float64(self.now),
                   self.step if first else np.full(m, -1, np.int32)))
    return rows
