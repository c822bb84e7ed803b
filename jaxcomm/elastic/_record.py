"""What `fit` records and returns: events, metric rows, membership lines, checkpoints.

Rows and checkpoints are written by the leader of the generation that committed them, so
that whichever process leads (process 0 may be dead) the files continue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from orbax.checkpoint import multihost as orbax_public_multihost
from orbax.checkpoint._src.multihost import multihost as orbax_multihost

from jaxcomm import train
from jaxcomm.elastic import _membership
from jaxcomm.train import Program, TrainState


def _print(line: str) -> None:
  # One write of the whole line: processes sharing a pipe do not interleave within it.
  sys.stderr.write(line + "\n")
  sys.stderr.flush()


@dataclasses.dataclass
class Event:
  """Something that happened to the run, as this process saw it."""
  step: int                 # the step of the round concerned
  kind: str                 # "failed": a round was discarded; "changed": the live set
                            # changed; "joined": processes were healed; "recovered": a round
                            # committed after failed ones
  processes: tuple = ()     # changed: the processes that left or came; joined: the joiners
  live: tuple = ()          # the live processes afterwards
  seconds: float = 0.0      # joined: time to heal; recovered: from the start of the first
                            # failed round to this commit


@dataclasses.dataclass
class Result:
  """What `fit` returns on every process."""
  state: TrainState         # this process's final state (on the last mesh)
  program: Program          # the program of the last mesh
  history: list             # metric rows of the logged steps (this process's workers)
  events: list              # `Event`s
  rounds: int               # rounds committed
  failed_rounds: int        # rounds discarded
  steps_redone: int         # steps computed again after a discarded round
  led: bool = False         # whether this process led the last committed generation


def local_scalar(x: jax.Array) -> np.ndarray:
  """This process's copy of a replicated value, or the mean of its devices' values."""
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  # Per-device measurements: one value per device (leading axis of size 1 on each).
  return np.mean(np.concatenate([np.asarray(s.data).reshape(-1) for s in x.addressable_shards]))


class _Saver:
  """The leader's checkpoints of the gathered state (a Checkpointer made when first used:
  a process that never leads never touches the directory).

  Orbax writes host (numpy) arrays and metadata only on the process whose index is 0 (its
  numpy handler tests `process_index() == 0`), whatever its `primary_host`; the leader may be
  any process, so it saves synchronously as orbax's process 0, alone (`processes={0}`).
  """

  def __init__(self, directory, every, keep):
    self.directory, self.every, self.keep = directory, every, keep
    self.checkpointer = None

  def save(self, snapshot, info) -> None:
    with _as_orbax_process_0():
      if self.checkpointer is None:
        self.checkpointer = train.Checkpointer(self.directory, every=self.every,
                                               keep=self.keep, async_save=False,
                                               processes={0})
      self.checkpointer.save(snapshot, force=True, info=info)
      self.checkpointer.wait()

  def close(self) -> None:
    if self.checkpointer is not None:
      with _as_orbax_process_0():
        self.checkpointer.close()


@contextlib.contextmanager
def _as_orbax_process_0():
  """Orbax's view of this process's index is 0 inside (see `_Saver`)."""
  saved = orbax_multihost.process_index, orbax_public_multihost.process_index
  orbax_multihost.process_index = orbax_public_multihost.process_index = lambda: 0
  try:
    yield
  finally:
    orbax_multihost.process_index, orbax_public_multihost.process_index = saved


class _Record:
  """What `fit` logs and returns: membership lines, events, metric rows."""

  def __init__(self, log, workdir):
    self.log, self.me, self.workdir = log, jax.process_index(), workdir
    self.result = Result(None, None, [], [], 0, 0, 0)
    self.total_bytes = 0
    self.failed_since = self.failed_at = self.live = None
    self.start = time.perf_counter()
    self.writer = None
    self.why_waiting = ""

  def waiting(self, step: int, why: str) -> None:
    """Logs (once) that rounds are empty from `step` on, and why; "" when they are not."""
    if why and why != self.why_waiting:
      self.log(f"elastic: process {self.me}: waiting at step {step}: {why}")
    self.why_waiting = why

  def failed(self, step: int, work: "_RoundWork", error: Exception, evicted: list,
             deadline: float) -> None:
    self.result.failed_rounds += 1
    self.result.steps_redone += work.computed
    self.failed_since = self.failed_since or work.began
    self.failed_at = step if self.failed_at is None else self.failed_at
    why = type(error).__name__ + (f": {str(error).splitlines()[0][:200]}" if str(error) else "")
    self.log(f"elastic: process {self.me}: round from step {step} discarded after "
             f"{time.perf_counter() - work.began:.1f} s ({why})"
             + (f"; evicted {evicted} (no vote within {deadline:.1f} s)" if evicted else "")
             + f"; keeping step {step} "
             f"[t={time.time():.3f}]")
    self.result.events.append(Event(step, "failed"))

  def committed(self, gen: _membership.Generation, work: "_RoundWork", lead: bool) -> None:
    self.result.rounds += 1
    self.result.led = lead
    live, me = gen.processes, self.me
    if self.live is not None and live != self.live:
      left = tuple(p for p in self.live if p not in live)
      came = tuple(p for p in live if p not in self.live)
      when = self.failed_at if self.failed_at is not None else work.first
      self.result.events.append(Event(when, "changed", left + came, live))
      self.log(f"elastic: process {me}: live set changed {list(self.live)} -> {list(live)} "
               f"at step {when}" + (f" (lost {list(left)})" if left else "")
               + (f" (joined {list(came)})" if came else ""))
    if work.healed is not None:
      outer, params, seconds = work.healed
      self.result.events.append(Event(work.first, "joined", gen.joiners, live, seconds))
      what = "joined" if me in gen.joiners else f"healed {list(gen.joiners)}"
      self.log(f"elastic: process {me}: {what} at step {work.first} from process {gen.donor} "
               f"in {seconds:.1f} s; digest of the replicated state {outer}, of the "
               f"parameters {params}")
    if self.failed_since is not None:
      seconds = time.perf_counter() - self.failed_since
      self.result.events.append(Event(self.failed_at, "recovered", (), live, seconds))
      self.log(f"elastic: process {me}: recovered in {seconds:.1f} s (from the start of the "
               f"round that failed at step {self.failed_at} to this commit at step "
               f"{work.stop}); live {list(live)} [t={time.time():.3f}]")
      self.failed_since = self.failed_at = None
    self.live = live
    for t, sent, per_device in work.rows:
      self.total_bytes += sent
      row = {"step": t, "wire_bytes": sent, "total_wire_bytes": self.total_bytes,
             "time": time.perf_counter() - self.start, "live": list(live)}
      row.update({k: float(local_scalar(x)) for k, x in per_device.items()})
      self.result.history.append(row)
      if lead and self.workdir is not None and self.writer is None:
        os.makedirs(self.workdir, exist_ok=True)
        self.writer = open(os.path.join(self.workdir, "metrics.jsonl"), "a", encoding="utf-8")
      if lead and self.writer:
        self.writer.write(json.dumps(row) + "\n")
        self.writer.flush()

  def close(self) -> None:
    if self.writer:
      self.writer.close()


@dataclasses.dataclass
class _RoundWork:
  """What a round did, kept until it commits."""
  began: float = 0.0          # perf_counter at the round's start
  first: int = 0
  stop: int = 0
  computed: int = 0
  rows: list = dataclasses.field(default_factory=list)
  snapshot: Any = None
  healed: tuple | None = None  # (digest of the replicated state, of the params, seconds)
