"""The elastic training loop: rounds of steps over the live islands, committed or discarded.

A round is the steps up to and including the next sync (`round_steps` = H for DiLoCo and
local SGD, 1 for data parallelism). Each round runs on the mesh of the live islands'
devices (a generation of `Membership`), under one `Membership.round`: either every live
process commits it or every one discards it and keeps the state it had before. So

* a process that dies mid-round costs the survivors that round (the step in flight, for
  DP; the outer period in flight, for DiLoCo), never a partial update; they redo it on the
  smaller mesh, where the method averages over the live islands only (an absent worker
  adds nothing: the semantics of `jaxcomm.local`'s participation masks);
* a process that (re)starts joins at the next round boundary, i.e. right after an outer
  sync: `heal` gives it a live peer's parameters and replicated state bit for bit and fresh
  per-worker optimiser state; it takes part in the next sync.

Islands are processes; every device is a worker of the method (its data-axis position).
Inner steps have no cross-process communication: measurements are read from this
process's devices only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxcomm import _validate as v
from jaxcomm import train
from jaxcomm.elastic import _membership
from jaxcomm.elastic import _state
from jaxcomm.train import Trainer, TrainState

# What a failed round can raise on a live process (collectives, the commit decision, the
# membership barrier); anything else is a bug and ends the process.
ROUND_FAILURES = (_membership.RoundAborted, multihost_utils.ProcessFailureError,
                  jax.errors.JaxRuntimeError)


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
  trainer: Trainer          # the trainer of the last mesh
  history: list             # metric rows of the logged steps (this process's workers)
  events: list              # `Event`s
  rounds: int               # rounds committed
  failed_rounds: int        # rounds discarded
  steps_redone: int         # steps computed again after a discarded round


def local_scalar(x: jax.Array) -> np.ndarray:
  """This process's copy of a replicated value, or the mean of its devices' values."""
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  # Per-device measurements: one value per device (leading axis of size 1 on each).
  return np.mean(np.concatenate([np.asarray(s.data).reshape(-1) for s in x.addressable_shards]))


def digest(tree: Any) -> str:
  """A short hash of this process's first copy of every leaf of `tree` (bit patterns).

  What a healed joiner and its donor print to show the copy was exact: the replicated state
  (for DiLoCo the outer parameters and outer optimiser state) is the same on every live
  process, and the joiner's parameters are its donor's.

  >>> import jax.numpy as jnp
  >>> digest({"w": jnp.ones(2)}) == digest({"w": jnp.ones(2)}) != digest({"w": jnp.zeros(2)})
  True
  """
  h = hashlib.sha256()
  for x in jax.tree.leaves(tree):
    data = x.addressable_shards[0].data
    if jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
      data = jax.random.key_data(data)
    h.update(np.ascontiguousarray(np.asarray(data)).tobytes())
  return h.hexdigest()[:16]


def replicated(trainer: Trainer, state: TrainState) -> list:
  """The leaves of the optimiser state that are the same on every worker."""
  return [x for pw, x in zip(jax.tree.leaves(trainer.layout.opt_state),
                             jax.tree.leaves(state.opt_state)) if not pw]


class _Island:
  """This process's side of the run: the committed state and the current generation."""

  def __init__(self, make_trainer, params, axis_name):
    self.make_trainer, self.params, self.axis_name = make_trainer, params, axis_name
    self.state = None          # committed state (on the mesh of `trainer_of_state`)
    self.trainer_of_state = None
    self.gen_index = None
    self.trainer = None
    self.template = None
    self.by_id = {d.id: d for d in jax.devices()}

  def prepare(self, gen: _membership.Generation) -> TrainState:
    """The state to run this round from, on the generation's mesh (healing joiners)."""
    if gen.index != self.gen_index:
      devices = [self.by_id[i] for i in gen.order]
      mesh = train.make_mesh({self.axis_name: len(devices)}, devices=devices)
      self.trainer = self.make_trainer(mesh)
      self.template = self.trainer.init(self.params)
      self.gen_index = gen.index
    state = self.state
    if self.trainer_of_state is not self.trainer:
      # A founder (generation 0) or a joiner starts from the template; a survivor keeps its
      # rows, which stay on its devices.
      state = _state.remesh(self.state, self.trainer, self.template)
    if gen.joiners:
      owners = [self.by_id[i].process_index for i in gen.order]
      state = _state.heal(self.trainer, state, [p in gen.joiners for p in owners],
                          owners.index(gen.donor))
    return state

  def commit(self, state: TrainState) -> None:
    self.state, self.trainer_of_state = state, self.trainer


def fit(make_trainer: Callable[[jax.sharding.Mesh], Trainer], params: Any,
        batch_fn: Callable[[int], dict], steps: int, *, round_steps: int,
        axis_name: str = "data", log_every: int = 10, workdir: str | None = None,
        checkpoint_every: int = 0, checkpointer: train.Checkpointer | None = None,
        timeout_s: float = 60.0,
        max_failed_rounds: int = 20, min_islands: int | Callable[[int], int] = 1,
        on_commit: Callable[[int], None] | None = None,
        log: Callable[[str], None] = _print) -> Result:
  """Trains `steps` steps on whichever islands are live, healing those that (re)join.

  Every process of the run calls it (a restarted one too, with the same arguments); the
  run must have been started with `jaxcomm.elastic.start_distributed`. On one process it
  trains plainly, in rounds.

  Args:
    make_trainer: `mesh -> Trainer` for a mesh with one data axis `axis_name` over the live
      devices (the method's collectives run over that axis).
    params: the initial (replicated) parameters; founders start from them, a joiner takes
      its peer's.
    batch_fn: `step -> this process's share of global batch number step` (numpy), as for
      `jaxcomm.train.fit`; a pure function of the step (a discarded round is redone). Each
      process feeds its own share, so the live islands' shares make up the batch.
    steps: the step number to stop at.
    round_steps: steps per round, the sync period of the method (H for DiLoCo and local
      SGD, 1 for DP); rounds end at multiples of it, so joiners join right after a sync.
    axis_name: the mesh's data axis.
    log_every: record metrics every this many steps (written when the round commits).
    workdir: where process 0 appends `metrics.jsonl` (None: nowhere).
    checkpoint_every: at the end of a round that reaches a multiple of it (and at the end),
      the live islands' whole state is gathered on process 0 (0: never).
    checkpointer: process 0's `Checkpointer(..., processes={0})`, which saves the gathered
      state (`info["islands"]` names the process of each worker row); None on the others.
    timeout_s: how long to wait for the other processes' votes and generation records.
    max_failed_rounds: give up after this many discarded rounds in a row.
    min_islands: a round runs only when at least this many islands are live (torchft's
      `min_replica_size`); below it the live ones wait, round after empty round, for
      others to join. An int, or `step -> int`.
    on_commit: called with the step reached after every committed round.
    log: where the membership lines go (stderr by default).

  Returns:
    A `Result`.

  >>> import jax.numpy as jnp, numpy as np, optax
  >>> from jaxcomm import local, train
  >>> tx = local.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2)
  >>> make = lambda mesh: train.Trainer(lambda p, b: jnp.mean((b["x"] * p["w"]) ** 2), tx,
  ...                                   mesh)
  >>> batch = {"x": np.ones(8, np.float32)}
  >>> out = fit(make, {"w": jnp.ones(())}, lambda step: batch, 4, round_steps=2)
  >>> out.rounds, int(out.state.step), round(float(out.state.opt_state.outer_params["w"]), 3)
  (2, 4, 0.41)
  """
  steps = v.integer("steps", steps, low=0)
  round_steps = v.integer("round_steps", round_steps, low=1)
  log_every = v.integer("log_every", log_every, low=1)
  max_failed_rounds = v.integer("max_failed_rounds", max_failed_rounds, low=1)
  checkpoint_every = v.integer("checkpoint_every", checkpoint_every, low=0)
  if checkpoint_every and jax.process_index() == 0 and (
      checkpointer is None or checkpointer.processes != {0}):
    raise ValueError("checkpoint_every > 0 needs process 0's checkpointer, built with "
                     "processes={0}: the live islands' state is gathered and saved there.")
  quorum = min_islands if callable(min_islands) else (lambda _, n=min_islands: n)
  membership = None if _membership.client() is None else _membership.Membership(timeout_s)
  island = _Island(make_trainer, params, axis_name)
  record = _Record(log, workdir)
  step, in_a_row = 0, 0
  try:
    while step < steps:
      work = _RoundWork(began=time.perf_counter())
      try:
        with _round(membership) as gen:
          if len(gen.processes) < quorum(step) and not gen.joiners:
            time.sleep(0.05)  # every live process sees the same generation: an empty round
            continue
          state = island.prepare(gen)
          if gen.joiners:
            work.healed = (digest(replicated(island.trainer, state)), digest(state.params),
                           time.perf_counter() - work.began)
          state = _run(island.trainer, state, batch_fn, steps, round_steps, log_every, work)
          if checkpoint_every and (work.stop % checkpoint_every == 0 or work.stop == steps):
            work.snapshot = _state.gather(island.trainer, state)
      except ROUND_FAILURES as e:
        if membership is None:
          raise  # one process: nothing to recover from
        if isinstance(e.__cause__, _membership.RunFinished):  # as the barrier reported it
          raise e.__cause__ from None
        if not membership.decided:  # (else: committed, and a process died just after)
          membership.failed()
          record.failed(step, work, e)
          in_a_row += 1
          if in_a_row >= max_failed_rounds:
            raise RuntimeError(f"{in_a_row} rounds in a row failed; giving up.") from e
          continue
      island.commit(state)
      if membership is not None:
        membership.committed()
      in_a_row = 0
      step = work.stop
      record.committed(gen, work)
      if work.snapshot is not None and checkpointer is not None:
        islands = [island.by_id[i].process_index for i in gen.order]
        checkpointer.save(work.snapshot, force=True,
                          info={"islands": islands, "total_wire_bytes": record.total_bytes})
      if on_commit is not None:
        on_commit(step)
    if membership is not None:
      membership.finish(step)
  except _membership.RunFinished as e:  # a (re)started process came too late
    record.log(f"elastic: process {jax.process_index()}: not joining, {e}")
  finally:
    record.close()
    if checkpointer is not None:
      checkpointer.wait()
  record.result.state, record.result.trainer = island.state, island.trainer
  return record.result


class _Record:
  """What `fit` logs and returns: membership lines, events, metric rows."""

  def __init__(self, log, workdir):
    self.log, self.me = log, jax.process_index()
    self.result = Result(None, None, [], [], 0, 0, 0)
    self.total_bytes = 0
    self.failed_since = self.failed_at = self.live = None
    self.start = time.perf_counter()
    self.writer = None
    if workdir is not None and self.me == 0:
      os.makedirs(workdir, exist_ok=True)
      self.writer = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")

  def failed(self, step: int, work: "_RoundWork", error: Exception) -> None:
    self.result.failed_rounds += 1
    self.result.steps_redone += work.computed
    self.failed_since = self.failed_since or work.began
    self.failed_at = step if self.failed_at is None else self.failed_at
    why = type(error).__name__ + (f": {str(error).splitlines()[0][:200]}" if str(error) else "")
    self.log(f"elastic: process {self.me}: round from step {step} discarded after "
             f"{time.perf_counter() - work.began:.1f} s ({why}); keeping step {step}")
    self.result.events.append(Event(step, "failed"))

  def committed(self, gen: _membership.Generation, work: "_RoundWork") -> None:
    self.result.rounds += 1
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
               f"{work.stop}); live {list(live)}")
      self.failed_since = self.failed_at = None
    self.live = live
    for t, sent, per_device in work.rows:
      self.total_bytes += sent
      row = {"step": t, "wire_bytes": sent, "total_wire_bytes": self.total_bytes,
             "time": time.perf_counter() - self.start, "live": list(live)}
      row.update({k: float(local_scalar(x)) for k, x in per_device.items()})
      self.result.history.append(row)
      if self.writer:
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


def _run(trainer: Trainer, state: TrainState, batch_fn, steps: int, round_steps: int,
         log_every: int, work: _RoundWork) -> TrainState:
  """The round's steps: from the state's step to the next multiple of `round_steps`."""
  work.first = int(local_scalar(state.step))
  work.stop = min(steps, (work.first // round_steps + 1) * round_steps)
  for t in range(work.first, work.stop):
    batch = trainer.shard_batch(batch_fn(t))
    state, per_device, sent = trainer.step_fn(state, batch)(state, batch)
    # One step at a time on CPU (see Trainer.step); also what the vote needs.
    jax.block_until_ready(state)
    work.computed += 1
    if (t + 1) % log_every == 0 or t + 1 == steps:
      scalars = {k: x for k, x in per_device.items() if isinstance(x, jax.Array)}
      work.rows.append((t + 1, int(local_scalar(sent)), scalars))
  return state


@contextlib.contextmanager
def _round(membership):
  if membership is not None:
    with membership.round() as gen:
      yield gen
    return
  devices = jax.devices()
  yield _membership.Generation(0, ((0, 0),), tuple(d.id for d in devices), (), 0)
