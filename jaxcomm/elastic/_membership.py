"""Who takes part: rounds over JAX's `live_devices`, one mesh order per generation, commits.

Membership is JAX's (`jax.experimental.multihost_utils.live_devices` with
`jax_enable_recoverability`): at the end of every round the live processes meet at a barrier
of the coordination service and all get the same live set, with each process's incarnation
(a restarted process gets a new one). What this module adds on top, through the service's
key-value store:

* **Generations.** Process 0 (it hosts the coordination service, so it is never the one
  that died) writes one record per generation: the mesh order of the live devices, the
  processes that must be healed (restarted or new ones) and the donor they copy. A new
  generation starts whenever the live set changes and after every failed round. Every
  process reads the record, so joiners, which know nothing of the past, act like the rest.
* **A fresh device order per generation.** XLA:CPU keeps one gloo communicator per ordered
  device list for the life of the process and never rebuilds it: after a collective failed
  on it, or once a member restarted, it is broken for good ("Gloo all-reduce failed:
  Application timeout caused pair closure"; the restarted process gets "Gloo context
  initialization failed: ALREADY_EXISTS: key cpu:gloo/0,2048,4096/2 already exists"). The
  mesh of a generation therefore uses an order of the islands (with each island's devices
  rotated) that was never used with other incarnations and never failed. There are
  N! x d such orders for N islands of d devices; running out raises.
* **One commit decision per round** (torchft's `should_commit`): each process votes, and
  the first process to decide (all voted yes: commit; a no or a missing vote: abort)
  writes the decision with a create-only key, so every process follows the same one even
  when a collective failed on some processes only (a timeout, not a death), which
  `live_devices` alone does not make atomic.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from typing import Iterator, NamedTuple

import jax
from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)

PREFIX = "jaxcomm/elastic"
FINISHED = f"{PREFIX}/finished"


class RoundAborted(RuntimeError):
  """The processes decided not to commit a round (a vote was no or missing)."""


class RunFinished(Exception):
  """The run reached its last step before this process could join it."""


class Generation(NamedTuple):
  """What every live process agreed on for a run of rounds."""
  index: int                # 0, 1, ...: generations before this one
  live: tuple               # ((process, incarnation), ...) sorted by process
  order: tuple              # device ids of the mesh, in mesh order
  joiners: tuple            # processes to heal in the generation's first committed round
  donor: int                # the process joiners copy

  @property
  def processes(self) -> tuple:
    return tuple(p for p, _ in self.live)


def client():
  """The coordination-service client of `jax.distributed` (None on a single process)."""
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  return distributed.global_state.client


def candidate_orders(islands: dict[int, list[int]]) -> Iterator[tuple]:
  """Device orders for a set of islands (process -> its device ids), the plainest first.

  Islands are permuted (lexicographically) and, within each permutation, every island's
  devices are rotated by the same amount; each island's devices stay contiguous.

  >>> list(candidate_orders({0: [0], 1: [5]}))
  [(0, 5), (5, 0)]
  >>> list(candidate_orders({0: [0, 1]}))
  [(0, 1), (1, 0)]
  """
  width = max(len(d) for d in islands.values())
  for rot in range(width):
    for perm in itertools.permutations(sorted(islands)):
      order = []
      for p in perm:
        devs = sorted(islands[p])
        k = rot % len(devs)
        order += devs[k:] + devs[:k]
      yield tuple(order)


class Planner:
  """Process 0's bookkeeping: which processes are healed, which orders are spent.

  Args:
    islands: process -> its device ids.
  """

  def __init__(self, islands: dict[int, list[int]]):
    self.islands = islands
    self.index = 0
    self.members: dict[int, int] = {}  # process -> incarnation of the last commit
    self.used: dict[tuple, tuple] = {}  # order -> the live set it was used with
    self.spent: set[tuple] = set()      # orders a failed round used

  def plan(self, live: tuple) -> dict:
    """The record of a new generation over `live` ((process, incarnation), ...)."""
    joiners = [p for p, inc in live if self.members and self.members.get(p) != inc]
    healed = [p for p, _ in live if p not in joiners]
    if not healed:
      raise RuntimeError(f"no live process holds the training state (live {live}, last "
                         f"committed members {self.members}).")
    order = self._order(live)
    self.used[order] = live
    record = {"index": self.index, "order": list(order), "joiners": joiners,
              "donor": min(healed)}
    self.index += 1
    return record

  def _order(self, live: tuple) -> tuple:
    islands = {p: self.islands[p] for p, _ in live}
    for order in candidate_orders(islands):
      if order not in self.spent and self.used.get(order, live) == live:
        return order
    raise RuntimeError(
        f"no unused device order left for the islands {sorted(islands)} (the CPU backend "
        f"cannot rebuild a gloo communicator: each membership change and each failed round "
        f"needs a device order never used before; give each process more devices).")

  def committed(self, live: tuple) -> None:
    self.members = dict(live)

  def failed(self, order: tuple) -> None:
    self.spent.add(order)


def decide(client, base: str, me: int, members: tuple, ok: bool, timeout_ms: int) -> bool:
  """One round's commit decision, the same on every member: True to commit.

  Each member writes its vote under `base`; a member that voted yes waits for the others'.
  The first member to know the outcome (all yes: commit; a no, or a vote missing after
  `timeout_ms`: abort) writes it to a create-only key, and every member returns what that
  key says, so a member that arrives late follows a decision already taken.

  >>> class Store(dict):  # the coordination service's key-value store, create-only
  ...   def key_value_set(self, key, value):
  ...     if key in self:
  ...       raise jax.errors.JaxRuntimeError("ALREADY_EXISTS")
  ...     self[key] = value
  ...   def blocking_key_value_get(self, key, timeout_ms):
  ...     return self[key]
  >>> store = Store()
  >>> decide(store, "r", 0, (0,), True, 1000)
  True
  """
  client.key_value_set(f"{base}/vote/{me}", "1" if ok else "0")
  outcome = "abort"
  if ok:
    try:
      votes = [client.blocking_key_value_get(f"{base}/vote/{p}", timeout_ms) for p in members]
      outcome = "commit" if all(v == "1" for v in votes) else "abort"
    except jax.errors.JaxRuntimeError:  # a vote did not come in time
      outcome = "abort"
  with contextlib.suppress(jax.errors.JaxRuntimeError):  # someone decided first
    client.key_value_set(f"{base}/decision", outcome)
  return client.blocking_key_value_get(f"{base}/decision", timeout_ms) == "commit"


class Membership:
  """Rounds of the live processes of a `jax.distributed` run with recoverability on.

  Args:
    timeout_s: how long a process waits for the others' votes and for a generation record.

  >>> try:  # one process: nothing to agree on
  ...   Membership()
  ... except RuntimeError as e:
  ...   print(str(e).split(" (")[0])
  elastic membership needs jax.distributed
  """

  def __init__(self, timeout_s: float = 60.0):
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
    self.planner = Planner(islands) if self.pid == 0 else None
    self.timeout_ms = int(timeout_s * 1000)
    self.generation: Generation | None = None
    self.decided = None         # the last round's decision: True (commit) or False
    self._records: dict[str, Generation] = {}
    self._failures: dict[tuple, int] = {}  # live set -> failed rounds so far
    self._round = 0             # rounds in this generation
    self._last_keys: list[str] = []

  # ---------------------------------------------------------------- rounds
  @contextlib.contextmanager
  def round(self) -> Iterator[Generation]:
    """One round: yields the generation; on exit all processes commit or all abort.

    Raises (on every live process alike) `RoundAborted`, JAX's `ProcessFailureError`, or
    the body's own exception when the round is not committed; `ProcessFailureError` also
    when a process died after the round was committed (`decided` tells which). A body
    that raises anything else still votes no, so the others abort instead of waiting.
    """
    self.decided = None
    with multihost_utils.live_devices(self.devices):
      live = tuple(sorted({d.process_index: inc for d, inc in
                           multihost_utils.live_devices.devices.items()}.items()))
      gen = self._generation(live)
      if gen != self.generation:
        self.generation, self._round = gen, 0
      try:
        yield gen
      except BaseException:
        self._decide(gen, ok=False)
        raise
      if not self._decide(gen, ok=True):
        raise RoundAborted(f"round {self._round} of generation {gen.index} was aborted by "
                           f"another process.")

  def _generation(self, live: tuple) -> Generation:
    failures = self._failures.get(live, 0)
    sig = ",".join(f"{p}:{inc}" for p, inc in live) + f"/{failures}"
    if sig not in self._records:
      key = f"{PREFIX}/generation/{sig}"
      if self.planner is not None:
        self.client.key_value_set(key, json.dumps(self.planner.plan(live)))
      record = json.loads(self._wait_for(key))
      self._records[sig] = Generation(record["index"], live, tuple(record["order"]),
                                      tuple(record["joiners"]), record["donor"])
    return self._records[sig]

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
    """Process 0, after the last round: tells processes still joining that it is over."""
    if self.pid == 0:
      self.client.key_value_set(FINISHED, str(step), allow_overwrite=True)

  def _decide(self, gen: Generation, ok: bool) -> bool:
    base = f"{PREFIX}/round/{gen.index}/{self._round}"
    self.decided = decide(self.client, base, self.pid, gen.processes, ok, self.timeout_ms)
    # Every process has read the previous round's keys before this round's barrier.
    for key in self._last_keys:
      with contextlib.suppress(jax.errors.JaxRuntimeError):
        self.client.key_value_delete(key)
    self._last_keys = [f"{base}/vote/{self.pid}"] + (
        [f"{base}/decision"] if self.pid == 0 else [])
    self._round += 1
    return self.decided

  # ---------------------------------------------------------------- outcomes
  def committed(self) -> None:
    """Records that the current generation's round committed (its joiners are healed)."""
    if self.planner is not None:
      self.planner.committed(self.generation.live)
    self.generation = self.generation._replace(joiners=())
    self._records = {k: (g._replace(joiners=()) if g.live == self.generation.live else g)
                     for k, g in self._records.items()}

  def failed(self) -> None:
    """Records that the current generation's round failed: its device order is spent."""
    if self.generation is None:
      return
    live = self.generation.live
    self._failures[live] = self._failures.get(live, 0) + 1
    if self.planner is not None:
      self.planner.failed(self.generation.order)
