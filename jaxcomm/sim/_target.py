"""Time to a target loss, read off a recorded loss curve and a simulated clock."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def smooth(losses: Sequence[float], window: int = 1) -> np.ndarray:
  """Trailing mean of the last `window` losses at every step (the first ones average fewer).

  >>> smooth([4.0, 2.0, 3.0], window=2).tolist()
  [4.0, 3.0, 2.5]
  """
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise ValueError(f"window must be an integer >= 1, got {window!r}.")
  losses = np.asarray(losses, dtype=np.float64)
  if losses.ndim != 1:
    raise ValueError(f"losses must be 1-D, got shape {losses.shape}.")
  sums = np.cumsum(np.concatenate([[0.0], losses]))
  idx = np.arange(1, len(losses) + 1)
  lo = np.maximum(idx - window, 0)
  return (sums[idx] - sums[lo]) / (idx - lo)


def time_to_target(losses: Sequence[float], times: Sequence[float], target: float, *,
                   window: int = 1) -> float | None:
  """The first time the (smoothed) loss is at or below `target`; None if it never is.

  A target that is never reached is reported as None ("not reached"), never as a time.

  Args:
    losses: the loss at each recorded step.
    times: the (simulated) time at which each of those steps was done, same length.
    target: the loss to reach.
    window: smooth the loss with a trailing mean over this many records first (training
      losses are noisy; one lucky batch should not count as reaching the target).

  Returns:
    Seconds, or None.

  >>> time_to_target([3.0, 2.0, 1.0], [1.0, 2.0, 3.0], target=2.0)
  2.0
  >>> time_to_target([3.0, 2.0, 1.0], [1.0, 2.0, 3.0], target=0.5) is None
  True
  """
  if isinstance(target, bool) or not isinstance(target, (int, float, np.floating)) or \
     not math.isfinite(target):
    raise ValueError(f"target must be a finite number, got {target!r}.")
  curve = smooth(losses, window)
  times = np.asarray(times, dtype=np.float64)
  if times.shape != curve.shape:
    raise ValueError(f"times has {times.size} entries but losses has {curve.size}.")
  hit = np.flatnonzero(curve <= target)
  return float(times[hit[0]]) if hit.size else None
