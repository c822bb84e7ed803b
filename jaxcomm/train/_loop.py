"""The training loop: steps, a progress line, and JSONL metrics in the workdir."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

import jax
import numpy as np

from jaxcomm.train import _validate
from jaxcomm.train._step import Trainer, TrainState


def _scalar(x) -> float:
  return float(np.asarray(x))


def fit(trainer: Trainer, state: TrainState, batch_fn: Callable[[int], dict], steps: int, *,
        workdir: str | None = None, log_every: int = 10, progress: bool = True,
        eval_fn: Callable[[TrainState], dict] | None = None) -> tuple[TrainState, list]:
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

  Returns:
    `(state, history)`: history is a list of metric dicts, one per logged step, with `step`,
    `loss`, `grad_norm`, `wire_bytes` (this step), `total_wire_bytes` and `time`.
  """
  _validate.fit_args(steps, log_every)
  writer = None
  if workdir is not None and jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    writer = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
  history, total_bytes, start = [], 0, time.perf_counter()
  first = int(np.asarray(state.step))
  try:
    for t in range(first, steps):
      state, m = trainer.step(state, trainer.shard_batch(batch_fn(t)))
      sent = int(np.asarray(m["wire_bytes"]))
      total_bytes += sent
      if (t + 1) % log_every == 0 or t + 1 == steps:
        row = {"step": t + 1, "wire_bytes": sent, "total_wire_bytes": total_bytes,
               "time": time.perf_counter() - start}
        row.update({k: _scalar(v) for k, v in m.items() if k not in ("wire_bytes", "per_worker")})
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
  finally:
    if writer:
      writer.close()
    if progress and jax.process_index() == 0 and steps > first:
      print(file=sys.stderr)
  return state, history
