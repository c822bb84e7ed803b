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
  per-worker optimiser state; it takes part in the next sync;
* a process that hangs (its vote missing at the progress deadline) is evicted like a dead
  one; live processes that cannot form a valid quorum (`Quorum`) stop with `QuorumLost`.

The leader of each generation (the lowest live process holding the state) writes the
metrics and the checkpoints, so no process is special.

Islands are processes; every device is a worker of the method (its data-axis position).
Inner steps have no cross-process communication: measurements are read from this
process's devices only.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxcomm import _validate as v
from jaxcomm import train
from jaxcomm.elastic import _membership
from jaxcomm.elastic import _quorum
from jaxcomm.elastic import _state
from jaxcomm.elastic._record import Result, _print, _Record, _RoundWork, _Saver
from jaxcomm.elastic._record import local_scalar
from jaxcomm.train import Program, TrainState

# What a failed round can raise on a live process (collectives, the commit decision, the
# membership barrier); anything else is a bug and ends the process.
ROUND_FAILURES = (_membership.RoundAborted, multihost_utils.ProcessFailureError,
                  jax.errors.JaxRuntimeError)


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


def replicated(program: Program, state: TrainState) -> list:
  """The leaves of the optimiser state that are the same on every worker."""
  return [x for pw, x in zip(jax.tree.leaves(program.layout.opt_state),
                             jax.tree.leaves(state.opt_state)) if not pw]


class _Island:
  """This process's side of the run: the committed state and the current generation."""

  def __init__(self, make_program, params, batch_axis):
    self.make_program, self.params, self.batch_axis = make_program, params, batch_axis
    self.state = None          # committed state (on the mesh of `program_of_state`)
    self.program_of_state = None
    self.gen_index = None
    self.program = None
    self.template = None
    self.by_id = {d.id: d for d in jax.devices()}

  def prepare(self, gen: _membership.Generation) -> TrainState:
    """The state to run this round from, on the generation's mesh (healing joiners)."""
    if gen.index != self.gen_index:
      devices = [self.by_id[i] for i in gen.order]
      mesh = train.make_mesh({self.batch_axis: len(devices)}, devices=devices)
      self.program = self.make_program(mesh)
      v.instance("make_program(mesh)", self.program, Program, "jaxcomm.train.Program")
      self.template = self.program.init(self.params)
      self.gen_index = gen.index
    state = self.state
    if self.program_of_state is not self.program:
      # A founder (generation 0) or a joiner starts from the template; a survivor keeps its
      # rows, which stay on its devices.
      state = _state.remesh(self.state, self.program, self.template)
    if gen.joiners:
      owners = [self.by_id[i].process_index for i in gen.order]
      state = _state.heal(self.program, state, [p in gen.joiners for p in owners],
                          owners.index(gen.donor))
    if self.program.config.donate:
      # The round's first step consumes its input, and the committed state (or the template)
      # must outlive a round that is discarded: the round runs on a copy.
      state = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), state)
    return state

  def commit(self, state: TrainState) -> None:
    self.state, self.program_of_state = state, self.program


def fit(make_program: Callable[[jax.sharding.Mesh], Program], params: Any,
        batch_fn: Callable[[int], dict], steps: int, *, round_steps: int,
        batch_axes: str = "data", log_every: int = 10, workdir: str | None = None,
        checkpoint_every: int = 0, checkpoint_dir: str | None = None, keep: int = 3,
        timeout_s: float = 60.0, max_failed_rounds: int = 20,
        quorum: _quorum.Quorum = _quorum.Quorum(), deadline_s: float | None = None,
        view: Callable[[int, tuple], tuple] | None = None,
        on_commit: Callable[[int], None] | None = None,
        log: Callable[[str], None] = _print) -> Result:
  """Trains `steps` steps on whichever islands are live, healing those that (re)join.

  Every process of the run calls it (a restarted one too, with the same arguments); the
  run must have been started with `jaxcomm.elastic.start_distributed`. On one process it
  trains plainly, in rounds.

  Args:
    make_program: `mesh -> Program` for a mesh with one axis `batch_axes` over the live
      devices (e.g. `lambda mesh: train.make_program(loss, tx, mesh, params)`; the method's
      collectives run over that axis).
    params: the initial (replicated) parameters; founders start from them, a joiner takes
      its peer's.
    batch_fn: `step -> this process's share of global batch number step` (numpy), as for
      `jaxcomm.train.fit`; a pure function of the step (a discarded round is redone). Each
      process feeds its own share, so the live islands' shares make up the batch.
    steps: the step number to stop at.
    round_steps: steps per round, the sync period of the method (H for DiLoCo and local
      SGD, 1 for DP); rounds end at multiples of it, so joiners join right after a sync.
    batch_axes: the name of the mesh's one axis, over which the batch is split.
    log_every: record metrics every this many steps (written when the round commits).
    workdir: where the generation's leader appends `metrics.jsonl` (None: nowhere).
    checkpoint_every: at the end of a round that reaches a multiple of it (and at the end),
      the live islands' whole state is gathered and the leader saves it in
      `checkpoint_dir` (`info["islands"]` names the process of each worker row; 0: never).
    checkpoint_dir: where checkpoints go (needed with `checkpoint_every`).
    keep: checkpoints kept.
    timeout_s: how long to wait for a generation record (and the progress deadline until
      round times are known).
    max_failed_rounds: give up after this many discarded rounds in a row.
    quorum: when the live islands may train on (`Quorum`); below it they wait, round after
      empty round, then stop with `QuorumLost`.
    deadline_s: the progress deadline (see `Membership`; None: from the round times).
    view: a fault hook for tests, `(step, live) -> live` as this process sees it.
    on_commit: called with the step reached after every committed round.
    log: where the membership lines go (stderr by default).

  Returns:
    A `Result`.

  Raises:
    QuorumLost: no valid quorum formed within `quorum.timeout_s` (the checkpoints written
      so far are complete).

  >>> import jax.numpy as jnp, numpy as np, optax
  >>> from jaxcomm import local, train
  >>> tx = local.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2)
  >>> make = lambda mesh: train.make_program(lambda p, b: jnp.mean((b["x"] * p["w"]) ** 2),
  ...                                        tx, mesh, {"w": jnp.ones(())})
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
  if checkpoint_every and not checkpoint_dir:
    raise ValueError("checkpoint_every > 0 needs checkpoint_dir: the generation's leader "
                     "saves the live islands' gathered state there.")
  membership = None if _membership.client() is None else _membership.Membership(
      timeout_s, quorum, deadline_s, admit_every=checkpoint_every, view=view)
  island = _Island(make_program, params, batch_axes)
  record = _Record(log, workdir)
  saver = _Saver(checkpoint_dir, checkpoint_every, keep)
  step, in_a_row = 0, 0
  try:
    while step < steps:
      work = _RoundWork(began=time.perf_counter())
      try:
        stop = min(steps, (step // round_steps + 1) * round_steps)  # (a holder's)
        with _round(membership, step, stop) as gen:
          if gen is None or jax.process_index() in gen.held:  # an empty round for it
            # (a joiner's own step is 0: the round's is the run's)
            record.waiting(membership.step, membership.waiting if gen is None else "held")
            continue
          record.waiting(step, "")
          state = island.prepare(gen)
          if gen.joiners:
            work.healed = (digest(replicated(island.program, state)), digest(state.params),
                           time.perf_counter() - work.began)
          state = _run(island.program, state, batch_fn, steps, round_steps, log_every, work)
          if checkpoint_every and (work.stop % checkpoint_every == 0 or work.stop == steps):
            work.snapshot = _state.gather(island.program, state)
      except ROUND_FAILURES as e:
        if membership is None:
          raise  # one process: nothing to recover from
        if isinstance(e.__cause__, (_membership.RunFinished, _membership.Evicted,
                                    _quorum.QuorumLost)):  # as the barrier reported it
          raise e.__cause__ from None
        if not membership.decided:  # (else: committed, and a process died just after)
          membership.failed()
          record.failed(step, work, e, membership.evicted, membership.deadline())
          in_a_row += 1
          if in_a_row >= max_failed_rounds:
            raise RuntimeError(f"{in_a_row} rounds in a row failed; giving up.") from e
          continue
      if gen is None or jax.process_index() in gen.held:
        continue
      island.commit(state)
      lead = gen.leader == jax.process_index()
      if membership is not None:
        membership.committed(time.perf_counter() - work.began)
      in_a_row = 0
      step = work.stop
      record.committed(gen, work, lead)
      if work.snapshot is not None and lead:
        islands = [island.by_id[i].process_index for i in gen.order]
        saver.save(work.snapshot, {"islands": islands, "total_wire_bytes": record.total_bytes})
      if on_commit is not None:
        on_commit(step)
    if membership is not None:
      membership.finish(step)
  except _membership.RunFinished as e:  # a (re)started process came too late
    record.log(f"elastic: process {jax.process_index()}: not joining, {e}")
  except _quorum.QuorumLost as e:
    record.log(f"elastic: {e}; stopping (last committed step {step})")
    raise
  finally:
    record.close()
    saver.close()
    if membership is not None:
      membership.close()
  record.result.state, record.result.program = island.state, island.program
  return record.result


def _run(program: Program, state: TrainState, batch_fn, steps: int, round_steps: int,
         log_every: int, work: _RoundWork) -> TrainState:
  """The round's steps: from the state's step to the next multiple of `round_steps`."""
  work.first = int(local_scalar(state.step))
  work.stop = min(steps, (work.first // round_steps + 1) * round_steps)
  for t in range(work.first, work.stop):
    batch = program.shard_batch(batch_fn(t))
    state, per_device, sent = program.step(state, batch)
    # One step at a time on CPU (see Program.dispatch); also what the vote needs.
    jax.block_until_ready(state)
    work.computed += 1
    if (t + 1) % log_every == 0 or t + 1 == steps:
      scalars = {k: x for k, x in per_device.items() if isinstance(x, jax.Array)}
      work.rows.append((t + 1, int(local_scalar(sent)), scalars))
  return state


@contextlib.contextmanager
def _round(membership, step, stop):
  if membership is not None:
    with membership.round(step, stop) as gen:
      yield gen
    return
  devices = jax.devices()
  yield _membership.Generation(0, ((0, 0),), tuple(d.id for d in devices), (), 0)
