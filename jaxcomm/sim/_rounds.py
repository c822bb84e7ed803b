"""Rounds of a local-update method on heterogeneous workers: how long each sync period takes.

In round r worker w computes its `worker_steps[w]` inner steps one after another (the
compute-time model's jobs r·H_w .. r·H_w + H_w − 1 of that worker), then every worker waits
for the slowest and the sync's communication runs. With one H for all, a slow worker makes
every round as long as its H steps; with per-worker H_w (`local.diloco(worker_steps=...)`)
the fast workers do more steps in the same time instead of waiting.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxcomm import _validate as v
from jaxcomm.sim._workers import ComputeModel


def round_seconds(model: ComputeModel, key: jax.Array, worker_steps: Sequence[int],
                  rounds: int, comm_seconds: float = 0.0) -> np.ndarray:
  """f64[rounds]: seconds of each round: the slowest worker's steps, plus the sync.

  Args:
    model: per-worker compute times (`fixed`, `lognormal`, `heavy_tailed`).
    key: the key the times are drawn with.
    worker_steps: inner steps per round of each worker (its length is the number of workers).
    rounds: number of rounds (sync periods).
    comm_seconds: seconds of one sync's communication, not overlapped.

  Returns:
    Each round's duration; its cumulative sum is the wall clock at each sync.

  >>> from jaxcomm.sim import fixed
  >>> times = fixed([1.0, 1.0, 2.0])
  >>> round_seconds(times, jax.random.key(0), [4, 4, 4], 2, 0.5).tolist()  # waits for w 2
  [8.5, 8.5]
  >>> round_seconds(times, jax.random.key(0), [4, 4, 2], 2, 0.5).tolist()
  [4.5, 4.5]
  """
  steps = np.asarray(worker_steps)
  if steps.ndim != 1 or steps.size < 1 or not np.issubdtype(steps.dtype, np.integer) \
     or np.any(steps < 1):
    raise ValueError(f"worker_steps must be a list of integers >= 1, one per worker; got "
                     f"{worker_steps!r}.")
  rounds = v.integer("rounds", rounds, low=1)
  if not np.isfinite(comm_seconds) or comm_seconds < 0:
    raise ValueError(f"comm_seconds must be a finite number >= 0, got {comm_seconds!r}.")
  table = model.table(key, steps.size, int(rounds * steps.max())).astype(np.float64)
  per_worker = np.stack([table[w, :rounds * s].reshape(rounds, s).sum(1)
                         for w, s in enumerate(steps)])
  return per_worker.max(0) + float(comm_seconds)
