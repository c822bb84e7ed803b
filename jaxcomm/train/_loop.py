"""The training loop: steps, a progress bar, metrics (JSONL and TensorBoard), checkpoints.

Nothing is read back from the devices between log steps: each step's byte count and
measurements stay on device until a log step (or a checkpoint) reads them, so the host
keeps dispatching on an accelerator instead of waiting for every step to finish.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Callable

import jax
import numpy as np

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.train import _metrics
from jaxcomm.train import _preemption
from jaxcomm.train._checkpoint import Checkpointer
from jaxcomm.train._program import Program
from jaxcomm.train._step import TrainState
from jaxcomm.train._trainer import Trainer

logger = logging.getLogger(__name__)


def _scalar(x) -> float:
  return float(np.asarray(x))


def fit(program: Program | Trainer, state: TrainState, batch_fn: Callable[[int], dict],
        steps: int, *, workdir: str | None = None, log_every: int = 10, progress: bool = True,
        eval_fn: Callable[[TrainState], dict] | None = None,
        checkpointer: Checkpointer | None = None,
        sim_step_seconds: Callable[[int], float] | None = None) -> tuple[TrainState, list]:
  """Runs `steps` training steps from `state.step`.

  Args:
    program: the `Program` (or a `Trainer`, whose `program` is taken).
    state: the train state to continue from (its `step` says where the data resumes).
    batch_fn: `step -> this process's share of global batch number step` (numpy), e.g.
      `data.batches(...).__getitem__`.
    steps: the step number to stop at (total steps, not additional ones).
    workdir: where `metrics.jsonl` is appended and TensorBoard event files are written
      (by process 0 only; `tensorboard --logdir <workdir>`), with the compiled step's
      wire bytes per mesh axis as a text table; None writes nothing.
    log_every: record metrics every this many steps (and at the last step). Only these
      steps read values back from the devices.
    progress: show a tqdm bar on stderr (rate, ETA, loss and bytes/step); it is off
      anyway when stderr is not a terminal.
    eval_fn: optional `state -> dict` of extra metrics computed at each log step.
    checkpointer: optional `Checkpointer`. The run first resumes from its newest readable
      checkpoint (if there is one, `state` only gives the structure and the metrics logged
      after that checkpoint are dropped from `metrics.jsonl`), then saves every
      `checkpointer.every` steps and at the end. When the run is preempted it saves the
      step it is at and returns early (the returned step is then < steps): on one process
      when SIGTERM arrives (caught while `fit` runs; the step under way is finished first),
      on a multi-host run when JAX's preemption notice arrives.
    sim_step_seconds: optional `wire bytes of a step -> its seconds on a simulated clock`
      (compute plus communication on a modelled link, e.g. with `comm.wire_bytes_time`);
      the running total is logged as `sim_seconds`. It treats steps as synchronous; a
      method that overlaps communication is timed after the run with `sim.simulate`.

  Returns:
    `(state, history)`: history is a list of metric dicts, one per logged step, with `step`,
    `loss`, `grad_norm`, `wire_bytes` (this step), `total_wire_bytes`, `time`, and
    `sim_seconds` (with `sim_step_seconds`) and, when parameters are per worker (local
    updates, gossip), `consensus_distance` after the logged step and
    `consensus_distance_before`, of the parameters it started from: before its sync (with a
    sync every `log_every` steps the distance after it is always ~0).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> from jaxcomm import sync, train
    >>> mesh = train.make_mesh({"data": 8})
    >>> loss = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
    >>> program = train.make_program(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)),
    ...                              mesh, {"w": jnp.zeros(1)})
    >>> batch = {"x": np.ones((8, 1), np.float32), "y": np.full((8, 1), 2.0, np.float32)}
    >>> state, history = fit(program, program.init({"w": jnp.zeros(1)}), lambda step: batch,
    ...                      3, progress=False)
    >>> int(state.step), len(history) > 0
    (3, True)
  """
  v.integer("steps", steps, low=0)
  v.integer("log_every", log_every, low=1)
  v.callable_("sim_step_seconds", sim_step_seconds, allow_none=True)
  if isinstance(program, Trainer):
    program = program.program
  v.instance("program", program, Program, "jaxcomm.train.Program (or Trainer)")
  totals = {"total_wire_bytes": 0, "sim_seconds": 0.0}
  if checkpointer is not None:
    state, info = _resume(checkpointer, program, state, workdir, progress)
    totals.update({k: info[k] for k in totals if k in info})
  first = int(np.asarray(state.step))
  writer = None
  if workdir is not None and jax.process_index() == 0:
    writer = _metrics.MetricsWriter(workdir, first)
  bar = _metrics.progress_bar(steps, first, progress)
  pending = []  # bytes of the steps since the last read, still on device
  history, start = [], time.perf_counter()

  def read_bytes() -> list[int]:
    step_bytes = [int(b) for b in jax.device_get(pending)]
    pending.clear()
    totals["total_wire_bytes"] += sum(step_bytes)
    if sim_step_seconds is not None:
      totals["sim_seconds"] += sum(float(sim_step_seconds(b)) for b in step_bytes)
    return step_bytes

  # SIGTERM (one process): finish this step, save it, stop.
  with _preemption.catch_sigterm(enabled=checkpointer is not None) as stop:
    try:
      for t in range(first, steps):
        batch = program.shard_batch(batch_fn(t))
        if writer and t == first:  # the bytes table needs only shapes: take them now
          example = jax.tree.map(_abstract, (state, batch))
        log = (t + 1) % log_every == 0 or t + 1 == steps
        # Read before the step consumes the state (donated): the workers' spread as the
        # logged step starts, before its sync (a sync every log_every steps leaves ~0 after).
        before = _consensus(program, state) if log else None
        state, per_device, sent = program.dispatch(state, batch)
        pending.append(sent)
        bar.update(1)
        if writer and t == first:
          report = comm.inspect(program.step, *example)
          writer.text("wire_bytes_per_axis", _metrics.bytes_table(report), t + 1)
        save = checkpointer is not None and checkpointer.due(t + 1, force=stop.requested)
        if not (log or save):
          continue
        step_bytes = read_bytes()
        if log:
          row = _row(program, state, per_device, t + 1, step_bytes[-1], totals,
                     time.perf_counter() - start, eval_fn, sim_step_seconds is not None,
                     before)
          history.append(row)
          if writer:
            writer.write(row)
          bar.set_postfix(loss=f"{row['loss']:.4f}", bytes_per_step=f"{row['wire_bytes']:,}",
                          refresh=False)
        if save:
          checkpointer.save(state, force=True, info=dict(totals), step=t + 1)
          if stop.requested or checkpointer.reached_preemption(t + 1):
            logger.warning("preempted: saved a checkpoint at step %d and stopped.", t + 1)
            break
      else:
        if checkpointer is not None:
          read_bytes()
          checkpointer.save(state, force=True, info=dict(totals), step=steps)
    finally:
      bar.close()
      if writer:
        writer.close()
      if checkpointer is not None:
        checkpointer.wait()
  return state, history


def _abstract(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _consensus(program: Program, state: TrainState):
  """The workers' consensus distance (on device), or None when the parameters are shared."""
  stacked = _metrics.per_worker_leaves(state.params, program.layout.params)
  return _metrics.consensus_distance(stacked) if stacked else None


def _row(program: Program, state: TrainState, per_device, step: int, sent: int, totals: dict,
         seconds: float, eval_fn, with_sim: bool, before=None) -> dict:
  """One log row: the step's measurements read back, the running totals and extras."""
  m = program.measure(per_device, None)
  m.pop("per_worker")
  row = {"step": step, "wire_bytes": sent, "total_wire_bytes": totals["total_wire_bytes"],
         "time": seconds}
  if with_sim:
    row["sim_seconds"] = totals["sim_seconds"]
  row.update({k: float(v) for k, v in jax.device_get(m).items()})
  after = _consensus(program, state)
  if after is not None:  # workers hold different parameters (local updates, gossip)
    row["consensus_distance"] = float(after)
  if before is not None:
    row["consensus_distance_before"] = float(before)
  if eval_fn is not None:
    row.update({k: _scalar(v) for k, v in eval_fn(state).items()})
  return row


def _resume(checkpointer: Checkpointer, program: Program, state: TrainState,
            workdir: str | None, progress: bool) -> tuple[TrainState, dict]:
  """The newest checkpoint's state and info (running totals), or `state`, {}; trims the
  metrics logged after it."""
  restored = checkpointer.restore(program, state)
  if restored is None:
    return state, {}
  state, info = restored
  step = int(np.asarray(state.step))
  if workdir is not None and jax.process_index() == 0:
    _drop_metrics_after(os.path.join(workdir, _metrics.METRICS_FILE), step)
  if progress and jax.process_index() == 0:
    print(f"resumed from the checkpoint at step {step} in {checkpointer.directory}",
          file=sys.stderr, flush=True)
  return state, info


def _drop_metrics_after(path: str, step: int) -> None:
  """Rows logged after the checkpoint are logged again by the resumed run: drop them."""
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.writelines(rows)
  os.replace(path + ".tmp", path)
