"""Time to a target loss and the steps a time budget allows, read off a recorded loss curve
and a simulated clock (`Timeline.known`: when each step's result is known)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxcomm import _validate as v


def smooth(losses: Sequence[float], window: int = 1) -> np.ndarray:
  """Trailing mean of the last `window` losses at every step (the first ones average fewer).

  >>> smooth([4.0, 2.0, 3.0], window=2).tolist()
  [4.0, 3.0, 2.5]
  """
  window = v.integer("window", window, low=1)
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
    times: when each of those steps' result is known (`Timeline.known`), same length;
      non-decreasing, so that the first step at or below the target is also the earliest.
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
  target = v.number("target", target)
  curve = smooth(losses, window)
  times = np.asarray(times, dtype=np.float64)
  if times.shape != curve.shape:
    raise ValueError(f"times has {times.size} entries but losses has {curve.size}.")
  _check_clock(times)
  hit = np.flatnonzero(curve <= target)
  return float(times[hit[0]]) if hit.size else None


def steps_within(times: Sequence[float], budget: float) -> int:
  """The most steps whose clock fits a time budget: the length of the longest prefix of
  `times` (when each step's result is known, `Timeline.known`) that is at most `budget`.

  >>> steps_within([1.0, 2.0, 2.0, 3.5], budget=2.0)
  3
  >>> steps_within([1.0, 2.0], budget=0.5)
  0
  """
  if isinstance(budget, bool) or not isinstance(budget, (int, float, np.floating)) or \
     not budget >= 0:
    raise ValueError(f"budget must be a number of seconds >= 0, got {budget!r}.")
  times = np.asarray(times, dtype=np.float64)
  if times.ndim != 1:
    raise ValueError(f"times must be 1-D, got shape {times.shape}.")
  _check_clock(times)
  return int(np.searchsorted(times, budget, side="right"))


def _check_clock(times: np.ndarray) -> None:
  if np.any(np.diff(times) < 0) or not np.all(np.isfinite(times)):
    raise ValueError("times must be finite and non-decreasing (a step's result is known no "
                     "earlier than an earlier step's): use Timeline.known, not Timeline.done.")
