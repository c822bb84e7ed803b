"""The training loop: steps, a progress line, JSONL metrics in the workdir, checkpoints."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Callable

import jax
import numpy as np

from jaxcomm.train import _preemption
from jaxcomm.train import _validate
from jaxcomm.train._checkpoint import Checkpointer
from jaxcomm.train._step import Trainer, TrainState

logger = logging.getLogger(__name__)


def _scalar(x) -> float:
  return float(np.asarray(x))


def fit(trainer: Trainer, state: TrainState, batch_fn: Callable[[int], dict], steps: int, *,
        workdir: str | None = None, log_every: int = 10, progress: bool = True,
        eval_fn: Callable[[TrainState], dict] | None = None,
        checkpointer: Checkpointer | None = None) -> tuple[TrainState, list]:
  """Runs `steps` training steps from `state.step`.

  Args:
    trainer: the step builder.
    state: the train state to continue from (its `step` says where the data resumes).
    batch_fn: `step -> this process's share of global batch number step` (numpy).
    steps: the step number to stop at (total steps, not additional ones).
    workdir: where `metrics.jsonl` is appended (by process 0 only); None writes nothing.
    log_every: record metrics every this many steps (and at the last step).
    progress: print a progress line on stderr.
    eval_fn: optional `state -> dict` of extra metrics computed at each log step.
    checkpointer: optional `Checkpointer`. The run first resumes from its newest readable
      checkpoint (if there is one, `state` only gives the structure and the metrics logged
      after that checkpoint are dropped from `metrics.jsonl`), then saves every
      `checkpointer.every` steps and at the end. When the run is preempted it saves the
      step it is at and returns early (the returned step is then < steps): on one process
      when SIGTERM arrives (caught while `fit` runs; the step under way is finished first),
      on a multi-host run when JAX's preemption notice arrives.

  Returns:
    `(state, history)`: history is a list of metric dicts, one per logged step, with `step`,
    `loss`, `grad_norm`, `wire_bytes` (this step), `total_wire_bytes` and `time`.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> from jaxcomm import sync, train
    >>> mesh = train.make_mesh({"data": 8})
    >>> loss = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
    >>> trainer = train.Trainer(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh)
    >>> batch = {"x": np.ones((8, 1), np.float32), "y": np.full((8, 1), 2.0, np.float32)}
    >>> state, history = fit(trainer, trainer.init({"w": jnp.zeros(1)}), lambda step: batch, 3,
    ...                      progress=False)
    >>> int(state.step), len(history) > 0
    (3, True)
  """
  _validate.fit_args(steps, log_every)
  total_bytes = 0
  if checkpointer is not None:
    state, total_bytes = _resume(checkpointer, trainer, state, workdir, progress)
  writer = None
  if workdir is not None and jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    writer = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
  history, start = [], time.perf_counter()
  first = int(np.asarray(state.step))
  # SIGTERM (one process): finish this step, save it, stop.
  with _preemption.catch_sigterm(enabled=checkpointer is not None) as stop:
    try:
      for t in range(first, steps):
        state, m = trainer.step(state, trainer.shard_batch(batch_fn(t)))
        sent = int(np.asarray(m["wire_bytes"]))
        total_bytes += sent
        if (t + 1) % log_every == 0 or t + 1 == steps:
          row = {"step": t + 1, "wire_bytes": sent, "total_wire_bytes": total_bytes,
                 "time": time.perf_counter() - start}
          row.update({k: _scalar(v) for k, v in m.items()
                      if k not in ("wire_bytes", "per_worker")})
          if eval_fn is not None:
            row.update({k: _scalar(v) for k, v in eval_fn(state).items()})
          history.append(row)
          if writer:
            writer.write(json.dumps(row) + "\n")
            writer.flush()
          if progress and jax.process_index() == 0:
            done = (t + 1 - first) / max(steps - first, 1)
            bar = "#" * int(30 * done)
            print(f"\r[{bar:<30}] step {t + 1}/{steps} loss {row['loss']:.4f} "
                  f"bytes/step {sent:,}", end="", file=sys.stderr, flush=True)
        if checkpointer is not None:
          info = {"total_wire_bytes": total_bytes}
          checkpointer.save(state, force=stop.requested, info=info)
          if stop.requested or checkpointer.reached_preemption(t + 1):
            logger.warning("preempted: saved a checkpoint at step %d and stopped.", t + 1)
            break
      else:
        if checkpointer is not None:
          checkpointer.save(state, force=True, info={"total_wire_bytes": total_bytes})
    finally:
      if writer:
        writer.close()
      if checkpointer is not None:
        checkpointer.wait()
      if progress and jax.process_index() == 0 and steps > first:
        print(file=sys.stderr)
  return state, history


def _resume(checkpointer: Checkpointer, trainer: Trainer, state: TrainState,
            workdir: str | None, progress: bool) -> tuple[TrainState, int]:
  """The newest checkpoint's state and byte total (or `state`, 0); trims later metrics."""
  restored = checkpointer.restore(trainer, state)
  if restored is None:
    return state, 0
  state, info = restored
  step = int(np.asarray(state.step))
  if workdir is not None and jax.process_index() == 0:
    _drop_metrics_after(os.path.join(workdir, "metrics.jsonl"), step)
  if progress and jax.process_index() == 0:
    print(f"resumed from the checkpoint at step {step} in {checkpointer.directory}",
          file=sys.stderr, flush=True)
  return state, int(info.get("total_wire_bytes", 0))


def _drop_metrics_after(path: str, step: int) -> None:
  """Rows logged after the checkpoint are logged again by the resumed run: drop them."""
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.writelines(rows)
  os.replace(path + ".tmp", path)
