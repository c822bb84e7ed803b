"""Who takes part: rounds over JAX's `live_devices`, one mesh order per generation, commits.

Membership is JAX's (`jax.experimental.multihost_utils.live_devices` with
`jax_enable_recoverability`): at the end of every round the live processes meet at a barrier
of the coordination service and all get the same live set, with each process's incarnation
(a restarted process gets a new one). What this module adds on top, through the service's
key-value store:

* **Generations, planned by a leader.** The coordination service runs in a process of its
  own (`python -m jaxcomm.elastic.coordinator`), so no worker is special: the leader of a
  generation is the lowest live process that holds the training state (not a joiner). It
  writes one record per generation: the mesh order of the live devices, the processes that
  must be healed (restarted or new ones), the donor they copy, and the bookkeeping below
  (so whichever process leads next, a joiner too once healed, continues it). A new
  generation starts whenever the live set changes and after every failed round. Every
  process reads the record, so joiners, which know nothing of the past, act like the rest.
* **Quorum rules** (`Quorum`), checked alike by every process on the agreed live set: at
  least `min_workers` processes, and a strict majority of the last committed quorum (two
  halves of a partition cannot both train on). A process that cannot form a valid quorum
  waits up to `timeout_s` for others, then stops (`QuorumLost`) instead of training alone.
  A join window lets a burst of restarts form one generation instead of several.
* **A fresh device order per generation.** XLA:CPU keeps one gloo communicator per ordered
  device list for the life of the process and never rebuilds it: after a collective failed
  on it, or once a member restarted, it is broken for good ("Gloo all-reduce failed:
  Application timeout caused pair closure"; the restarted process gets "Gloo context
  initialization failed: ALREADY_EXISTS: key cpu:gloo/0,2048,4096/2 already exists"). The
  mesh of a generation therefore uses an order of the islands (with each island's devices
  rotated) that was never used with other incarnations and never failed. There are
  N! x d such orders for N islands of d devices; running out raises.
* **One commit decision per round** (torchft's `should_commit`): each process votes, and
  the first process to decide (all voted yes: commit; a no or a vote missing after the
  progress deadline: abort) writes the decision with a create-only key, so every process
  follows the same one even when a collective failed on some processes only (a timeout,
  not a death), which `live_devices` alone does not make atomic. A member whose vote is
  missing at the deadline is evicted: the decision names it, and its own watchdog thread
  (alive while its main thread hangs) ends it, so the next barrier does not wait for it.
* **A bounded barrier.** JAX's membership barrier has no timeout and waits for every
  process the service holds live; a process that hangs after its vote keeps heartbeating.
  Each process marks its arrival, and one missing the progress deadline after a peer
  arrived is evicted like a missed vote. A process that did not run for longer than the
  heartbeat timeout (SIGSTOP) ends itself when it resumes (`_watchdog`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import statistics
import sys
import threading
import time
from typing import Callable, Iterator, NamedTuple

import jax
from jax._src import distributed
from jax.experimental import multihost_utils

from jaxcomm.elastic._agreement import Planner, arrive, candidate_orders, decide, missing
from jaxcomm.elastic._quorum import Quorum, QuorumLost
from jaxcomm.elastic._service import connected_heartbeat_timeout
from jaxcomm.elastic._watchdog import Watchdog, evicted_key

logger = logging.getLogger(__name__)

PREFIX = "jaxcomm/elastic"
FINISHED = f"{PREFIX}/finished"
COMMITTED = f"{PREFIX}/committed"  # {"step", "members"} of the last commit, for joiners

__all__ = ("Evicted", "Generation", "Membership", "Planner", "QuorumLost", "RoundAborted",
           "RunFinished", "candidate_orders", "client", "decide")


class RoundAborted(RuntimeError):
  """The processes decided not to commit a round (a vote was no or missing)."""


class RunFinished(Exception):
  """The run reached its last step before this process could join it."""


class Evicted(RuntimeError):
  """The others evicted this process: its vote was missing at the progress deadline."""


class Generation(NamedTuple):
  """What every live process agreed on for a run of rounds."""
  index: int                # 0, 1, ...: generations before this one
  live: tuple               # ((process, incarnation), ...) of the mesh, sorted by process
  order: tuple              # device ids of the mesh, in mesh order
  joiners: tuple            # processes to heal in the generation's first committed round
  donor: int                # the process joiners copy
  leader: int = 0           # the process that planned it (writes metrics, checkpoints)
  held: tuple = ()          # live processes kept out of the mesh until a checkpoint step

  @property
  def processes(self) -> tuple:
    return tuple(p for p, _ in self.live)


def client():
  """The coordination-service client of `jax.distributed` (None on a single process)."""
  return distributed.global_state.client



class Membership:
  """Rounds of the live processes of a `jax.distributed` run with recoverability on.

  Args:
    timeout_s: how long a process waits for a generation record.
    quorum: the quorum rules (`Quorum`).
    deadline_s: the progress deadline: how long after its own vote a process waits for the
      others' before the round is aborted and the missing ones evicted. None: 3x the median
      time of this process's committed rounds (at least 5 s), `timeout_s` until 3 rounds
      have committed.
    admit_every: with `quorum.shrink_only`, joiners are admitted only at rounds that start
      at a multiple of this step (the checkpoint interval).
    view: a fault hook, `(step, live) -> live` as this process sees it (tests partition
      the run with it); None: the live set as the coordination service reports it.
    heartbeat_timeout_s: the coordination service's heartbeat timeout: a process that did
      not run for longer (SIGSTOPped) was declared dead, and its watchdog ends it (exit
      status `EVICTED`) before JAX's client aborts it. None: the one
      `jaxcomm.elastic.start_distributed` connected with (not checked without it).

  >>> try:  # one process: nothing to agree on
  ...   Membership()
  ... except RuntimeError as e:
  ...   print(str(e).split(" (")[0])
  elastic membership needs jax.distributed
  """

  def __init__(self, timeout_s: float = 60.0, quorum: Quorum = Quorum(),
               deadline_s: float | None = None, admit_every: int = 0,
               view: Callable[[int, tuple], tuple] | None = None,
               heartbeat_timeout_s: float | None = None):
    self.client = client()
    if self.client is None:
      raise RuntimeError("elastic membership needs jax.distributed (see "
                         "jaxcomm.elastic.start_distributed).")
    if not jax.config.jax_enable_recoverability:
      raise RuntimeError("elastic membership needs jax_enable_recoverability (set by "
                         "jaxcomm.elastic.start_distributed before jax.distributed starts).")
    self.pid = jax.process_index()
    self.devices = jax.devices()
    islands: dict[int, list[int]] = {}
    for d in self.devices:
      islands.setdefault(d.process_index, []).append(d.id)
    self.planner = Planner(islands)   # every process: a copy of the leader's bookkeeping
    self.timeout_ms = int(timeout_s * 1000)
    self.quorum, self.deadline_s, self.admit_every = quorum.check(), deadline_s, admit_every
    self.view = view
    self.generation: Generation | None = None
    self.decided = None         # the last round's decision: True (commit) or False
    self.evicted: list = []     # processes the last decision evicted
    self.waiting = ""           # why the last round was empty ("" if it was not)
    self.round_seconds: list[float] = []
    self._records: dict[str, Generation] = {}
    self._failures: dict[tuple, int] = {}  # live set -> failed rounds so far
    self._last_keys: list[str] = []
    self._timer = None          # evicts those missing at the barrier (`_bounded_barrier`)
    self._seen = None           # the live set of the previous round
    self._lost_since = None     # when the quorum was first found invalid
    self._streak = 0            # rounds over the same live set so far
    self._joining = _exists(self.client, COMMITTED)  # a run under way: this process joins
    self.step = None            # where the current round starts
    if heartbeat_timeout_s is None:
      heartbeat_timeout_s = connected_heartbeat_timeout()
    self.watchdog = Watchdog(self.client, evicted_key(PREFIX, self.pid), heartbeat_timeout_s,
                             lambda: (getattr(self.generation, "index", None), self.step))
    atexit.register(self.close)

  # ---------------------------------------------------------------- rounds
  @contextlib.contextmanager
  def round(self, step: int, stop: int | None = None) -> Iterator[Generation | None]:
    """One round from `step` to `stop` (default `step`): yields its generation (None: an
    empty round, `waiting` says why); on exit all processes commit or all abort. On a
    commit the generation's leader records `stop` and the members for the processes that
    join next, before the membership barrier (so a joiner, once past it, reads this round's).

    Raises (on every live process alike) `RoundAborted`, JAX's `ProcessFailureError`, or
    the body's own exception when the round is not committed; `ProcessFailureError` also
    when a process died after the round was committed (`decided` tells which);
    `QuorumLost` once no valid quorum has formed for `quorum.timeout_s`; `Evicted` on a
    process the others evicted. A body that raises anything else still votes no, so the
    others abort instead of waiting.
    """
    self.decided, self.evicted, self.waiting, self.step = None, [], "", step
    with self._bounded_barrier(), multihost_utils.live_devices(self.devices):
      live = tuple(sorted({d.process_index: inc for d, inc in
                           multihost_utils.live_devices.devices.items()}.items()))
      self.watchdog.incarnation = dict(live).get(self.pid)
      if self.view is not None:
        live = tuple(self.view(step, live))
      self._streak = self._streak + 1 if live == self._seen else 0
      gen = self._form(live, step)
      # Held processes (shrink_only) do not vote: they follow the members' decision.
      members = gen.processes if gen is not None else tuple(p for p, _ in live)
      # Unique per round and the same on every member (joiners too): rounds over one live
      # set are counted from the first of them.
      base = f"{PREFIX}/round/{gen.index if gen else '-'}/{_sig(live)}/{self._streak}"
      try:
        yield gen
      except BaseException:
        self._decide(base, members, ok=False)
        raise
      if not self._decide(base, members, ok=True):
        raise RoundAborted(f"round {self._streak} over {_sig(live)} was aborted"
                           + (f"; evicted {self.evicted} (no vote within "
                              f"{self.deadline():.1f} s)" if self.evicted else ""))
      if gen is not None and gen.leader == self.pid:
        self.client.key_value_set(COMMITTED, json.dumps(
            {"step": step if stop is None else stop,
             "members": sorted(dict(gen.live).items())}), allow_overwrite=True)

  @contextlib.contextmanager
  def _bounded_barrier(self):
    """Bounds the wait at JAX's membership barrier, which has no timeout of its own.

    `live_devices` meets at its barrier when its block exits, right after the round's
    decision, and waits for every process the coordination service holds live; a process
    that hangs between its vote and the barrier keeps heartbeating. So after the decision
    each process marks its arrival (`_arrive`), and one not there `deadline()` after a peer
    arrived is evicted like a missed vote: its watchdog ends it, and the barrier goes on.
    """
    try:
      yield
    finally:  # the barrier is over (or never began)
      if self._timer is not None:
        self._timer.cancel()
        self._timer = None

  def _arrive(self, base: str) -> None:
    expected = {p: inc for p, inc in self._seen if p not in self.evicted}
    arrive(self.client, base, self.pid)
    self._timer = threading.Timer(self.deadline(), self._evict_late, (base, expected))
    self._timer.daemon = True
    self._timer.start()

  def _evict_late(self, base: str, expected: dict) -> None:
    for p in missing(self.client, base, expected):
      sys.stderr.write(f"elastic: process {self.pid}: process {p} voted but did not reach "
                       f"the membership barrier within {self.deadline():.1f} s; evicting it\n")
      self._evict(p, expected[p])

  def _evict(self, process: int, incarnation) -> None:
    """Writes `process`'s incarnation under its eviction key: its watchdog reads it and ends
    it (a late write from an earlier generation names an older incarnation: ignored)."""
    with contextlib.suppress(jax.errors.JaxRuntimeError):
      self.client.key_value_set(evicted_key(PREFIX, process), str(incarnation),
                                allow_overwrite=True)

  def _form(self, live: tuple, step: int) -> Generation | None:
    """The generation of this round over `live`, or None (an empty round)."""
    if self._joining:   # knows nothing of the run yet: reads what the others committed
      committed = _try_json(self.client, COMMITTED)
      if committed:
        step = self.step = committed["step"]
        self.planner.members = {p: inc for p, inc in committed["members"]}
    came = self._seen is not None and any(x not in self._seen for x in live)
    first = self._seen is None and self._joining
    self._seen = live
    if self.quorum.join_window_s and (came or first):
      self.waiting = f"join window ({self.quorum.join_window_s} s)"
      time.sleep(self.quorum.join_window_s)
      return None
    holders = [p for p, inc in live if not self.planner.members
               or self.planner.members.get(p) == inc]
    why = self.quorum.violations([p for p, _ in live], list(self.planner.members), step)
    if why:
      self._lost_since = self._lost_since or time.monotonic()
      if time.monotonic() - self._lost_since > self.quorum.timeout_s:
        raise QuorumLost(f"process {self.pid}: no valid quorum for "
                         f"{self.quorum.timeout_s} s at step {step}: " + "; ".join(why))
      self.waiting = "; ".join(why)
      time.sleep(0.05)
      return None
    self._lost_since = None
    held = ()
    if (self.quorum.shrink_only and self.planner.members and self.admit_every
        and step % self.admit_every):
      held = tuple(p for p, _ in live if p not in holders)
      live = tuple(x for x in live if x[0] not in held)
    return self._generation(live, held)

  def _generation(self, live: tuple, held: tuple) -> Generation:
    failures = self._failures.get(live, 0)
    sig = _sig(live) + f"/{failures}" + (f"/held{list(held)}" if held else "")
    if sig not in self._records:
      key = f"{PREFIX}/generation/{sig}"
      if not self._joining and self.planner.leader(live) == self.pid:
        record = self.planner.plan(live)
        self.client.key_value_set(key, json.dumps(record))
      record = json.loads(self._wait_for(key))
      self.planner.load(record["state"])
      self._records[sig] = Generation(record["index"], live, tuple(record["order"]),
                                      tuple(record["joiners"]), record["donor"],
                                      record["leader"], held)
    self.generation = self._records[sig]
    return self.generation

  def _wait_for(self, key: str) -> str:
    """The value of `key` once written; `RunFinished` if the run ended first."""
    deadline = time.monotonic() + self.timeout_ms / 1000
    while True:
      with contextlib.suppress(jax.errors.JaxRuntimeError):  # not there yet
        return self.client.key_value_try_get(key)
      with contextlib.suppress(jax.errors.JaxRuntimeError):
        raise RunFinished(f"the run finished at step "
                          f"{self.client.key_value_try_get(FINISHED)}")
      if time.monotonic() > deadline:
        raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: no {key} after "
                                         f"{self.timeout_ms} ms")
      time.sleep(0.01)

  def finish(self, step: int) -> None:
    """After the last round: tells processes still joining that the run is over."""
    self.client.key_value_set(FINISHED, str(step), allow_overwrite=True)

  def deadline(self) -> float:
    """The progress deadline in seconds (see `deadline_s`)."""
    if self.deadline_s is not None:
      return self.deadline_s
    if len(self.round_seconds) < 3:
      return self.timeout_ms / 1000
    return max(5.0, 3 * statistics.median(self.round_seconds[-20:]))

  def _decide(self, base: str, members: tuple, ok: bool) -> bool:
    if self.pid in members:
      outcome = decide(self.client, base, self.pid, members, ok,
                       int(self.deadline() * 1000))
    else:
      outcome = json.loads(self._wait_for(f"{base}/decision"))
    self.decided, self.evicted = outcome["commit"], outcome["evicted"]
    for p in self.evicted:
      self._evict(p, dict(self._seen or ()).get(p))
    if self.pid in self.evicted:
      raise Evicted(f"process {self.pid} was evicted by the others (no vote within the "
                    f"progress deadline)")
    # Every process has read the previous round's keys before this round's barrier.
    for key in self._last_keys:
      with contextlib.suppress(jax.errors.JaxRuntimeError):
        self.client.key_value_delete(key)
    self._last_keys = [f"{base}/vote/{self.pid}", f"{base}/decision", f"{base}/arrived/{self.pid}"]
    self._arrive(base)
    return self.decided

  # ---------------------------------------------------------------- outcomes
  def committed(self, seconds: float) -> None:
    """Records that the current generation's round committed (its joiners are healed) and
    took `seconds`."""
    gen = self.generation
    self.planner.committed(gen.live)
    self._joining = False
    self.round_seconds.append(seconds)
    self.generation = gen._replace(joiners=())
    self._records = {k: (g._replace(joiners=()) if g.live == gen.live else g)
                     for k, g in self._records.items()}

  def failed(self) -> None:
    """Records that the current generation's round failed: its device order is spent."""
    if self.generation is None:
      return
    live = self.generation.live
    self._failures[live] = self._failures.get(live, 0) + 1
    self.planner.failed(self.generation.order)

  def close(self) -> None:
    """Stops the watchdog thread (at the end of `fit`, and at exit)."""
    self.watchdog.close()


def _sig(live: tuple) -> str:
  return ",".join(f"{p}:{inc}" for p, inc in live)


def _exists(client_, key: str) -> bool:
  try:
    client_.key_value_try_get(key)
    return True
  except jax.errors.JaxRuntimeError:
    return False


def _try_json(client_, key: str):
  try:
    return json.loads(client_.key_value_try_get(key))
  except jax.errors.JaxRuntimeError:
    return None
