"""How one trial of experiments.compare did on one link: the steps its budget allows, the
evaluations that count there, and its time to the target.

The held-out loss is evaluated at fixed intervals of simulated time on each link (untimed):
at the first step whose clock (`Timeline.known`) reaches each multiple of the link's
interval. A step grid (every N steps) is not the same: its spacing in time is N times a
method's step time, so a method with slow steps (the reference on a slow link) would be
read at coarser times than one with fast steps, and the error of a time to target (up to
one spacing) would differ between them. On a time grid every method on a link is read at
the same resolution. The losses do not depend on the link, so a trial is evaluated at the
union of its links' grids, and each link reads its own grid only.

Plain numpy on recorded numbers: tested on synthetic clocks.
"""

from __future__ import annotations

import math

import numpy as np

from jaxcomm import sim

# How a trial ended on a link (besides reaching the target).
REACHED, BUDGET, CAP = "reached", "budget spent", "step cap"
_TOLERANCE = 1e-9  # a clock equal to a multiple of the interval up to rounding reaches it


def grid_steps(known, interval: float | None) -> np.ndarray:
  """The steps (1-based) at which the clock `known` first reaches each multiple of
  `interval` seconds: where a link's held-out evaluations fall. A step that reaches several
  multiples at once is one evaluation. `interval` None: every step.

  >>> grid_steps([0.4, 0.8, 1.2, 2.9, 3.0, 3.1], 1.0).tolist()
  [3, 4, 5]
  """
  known = np.asarray(known, np.float64)
  if interval is None:
    return np.arange(1, known.size + 1)
  reached = np.floor(known / interval + _TOLERANCE)
  before = np.concatenate([[0.0], reached[:-1]])
  return np.flatnonzero(reached > before) + 1


def on_grid(eval_steps, known, interval: float | None) -> np.ndarray:
  """bool[E]: which evaluations (at `eval_steps`) are on the grid of `interval` seconds of
  the clock `known` (all of them for `interval` None).

  >>> on_grid([2, 3, 4, 6], [0.4, 0.8, 1.2, 2.9, 3.0, 3.1], 1.0).tolist()
  [False, True, True, False]
  """
  return np.isin(np.asarray(eval_steps, np.int64), grid_steps(known, interval))


def multiples(known_last: float, interval: float) -> int:
  """How many multiples of `interval` a clock of `known_last` seconds has reached."""
  return int(math.floor(known_last / interval + _TOLERANCE))


def account(eval_steps, eval_losses, known, target: float, budget: float,
            max_steps: int) -> dict:
  """How a trial did on one link, from its held-out evaluations and its clock.

  The link allows the steps whose clock (`Timeline.known`) fits the budget; within them the
  time to the target is the clock at the first evaluation given (those on the link's grid,
  `on_grid`) whose held-out loss is at or below the target. A trial that does not get there
  ended by "budget spent", or by "step cap" when every step it trained (`max_steps`)
  fitted in the budget.

  Returns:
    {"steps": steps in the budget (of those trained), "seconds": their clock,
    "time_to_target", "steps_to_target" (None when not reached), "stopped"}.
  """
  known = np.asarray(known, np.float64)
  eval_steps = np.asarray(eval_steps, np.int64)
  eval_losses = np.asarray(eval_losses, np.float64)
  if eval_steps.shape != eval_losses.shape:
    raise ValueError(f"{eval_steps.size} evaluation steps but {eval_losses.size} losses.")
  steps = sim.steps_within(known, budget)
  hit = np.flatnonzero((eval_steps <= steps) & (eval_losses <= target))
  out = {"steps": steps, "seconds": float(known[steps - 1]) if steps else 0.0,
         "time_to_target": None, "steps_to_target": None}
  if hit.size:
    at = int(eval_steps[hit[0]])
    out.update(time_to_target=float(known[at - 1]), steps_to_target=at, stopped=REACHED)
  else:
    out["stopped"] = CAP if steps >= max_steps else BUDGET
  return out


def steps_to_try(known: np.ndarray, budget: float, cap: int) -> int:
  """The steps to train to next: the most the clock so far suggests fit in `budget`, plus
  the one that shows it is spent."""
  trained = len(known)
  per_step = known[-1] / trained
  more = math.floor((budget - known[-1]) / per_step) + 1 if per_step > 0 else cap
  return min(cap, trained + max(more, 1))
