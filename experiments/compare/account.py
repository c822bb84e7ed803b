"""How one trial of experiments.compare did on one link: the steps its budget allows, the
evaluations that count there, and its time to the target.

The held-out loss is evaluated at fixed intervals of simulated time on each link (untimed):
at the first step whose clock (`Timeline.known`) reaches each multiple of the link's
interval. A step grid (every N steps) is not the same: its spacing in time is N times a
method's step time, so a method with slow steps (the reference on a slow link) would be
read at coarser times than one with fast steps, and the error of a time to target (up to
one spacing) would differ between them. On a time grid every method on a link is read at
the same resolution. The losses do not depend on the link, so a trial is evaluated at the
union of its links' grids, and each link reads its own grid only; every trial is also read
at step 0 (its initial parameters) and, when the step cap stops it, at its last step.

The time to the target is interpolated between the two readings around it: the held-out
loss is taken as linear in steps between the last reading above the target and the first at
or below it, the step where that line crosses the target is the steps to the target (a
fraction), and the time is the clock there (linear between whole steps; 0 at step 0). Two
methods that both reach the target at their first reading are told apart by how far below
the target that reading is.

Plain numpy on recorded numbers: tested on synthetic clocks.
"""

from __future__ import annotations

import math

import numpy as np

from jaxcomm import sim

# How a trial ended on a link (besides reaching the target). NOT_EVALUATED: no reading after
# step 0 within the budget (never counted as a miss).
REACHED, BUDGET, CAP, NOT_EVALUATED = "reached", "budget spent", "step cap", "not evaluated"
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


def clock_at(known, steps: float) -> float:
  """The clock `known` (Timeline.known: step t ends at known[t - 1]) at a fractional step,
  linear between whole steps, 0 at step 0.

  >>> clock_at([0.5, 1.0, 3.0], 2.5)
  2.0
  """
  known = np.asarray(known, np.float64)
  return float(np.interp(steps, np.arange(known.size + 1), np.concatenate([[0.0], known])))


def crossing(before: tuple, after: tuple, target: float) -> float:
  """The step where the loss, linear between readings `before` = (step, loss) above the
  target and `after` at or below it, reaches the target.

  >>> crossing((10, 3.0), (20, 2.0), 2.5)
  15.0
  """
  (s0, l0), (s1, l1) = before, after
  if l0 <= target or l0 == l1:
    return float(s1 if l0 > target else s0)
  return float(s0 + (l0 - target) / (l0 - l1) * (s1 - s0))


def steps_to(eval_steps, eval_losses, target: float) -> float | None:
  """The steps to `target` from held-out readings in step order: interpolated between the
  last reading above it and the first at or below it (`crossing`); None when none is.

  >>> steps_to([0, 10, 20], [3.0, 2.5, 2.0], 2.25)
  15.0
  """
  hit = np.flatnonzero(np.asarray(eval_losses, np.float64) <= target)
  if not hit.size:
    return None
  i = int(hit[0])
  return crossing((eval_steps[i - 1], eval_losses[i - 1]) if i else (eval_steps[i], target),
                  (eval_steps[i], eval_losses[i]), target)


def account(eval_steps, eval_losses, known, target: float, budget: float,
            max_steps: int) -> dict:
  """How a trial did on one link, from its held-out evaluations and its clock.

  The link allows the steps whose clock (`Timeline.known`) fits the budget; within them the
  steps to the target are interpolated between the readings given (those on the link's
  grid, `on_grid`, step 0 and a last reading) around the first one at or below the target
  (module docstring), and the time is the clock there. A trial that does not get there
  ended by "budget spent", or by "step cap" when every step it trained (`max_steps`)
  fitted in the budget; one with no reading after step 0 in the budget is "not evaluated".

  Returns:
    {"steps": steps in the budget (of those trained), "seconds": their clock,
    "time_to_target", "steps_to_target" (a fraction; None when not reached), "stopped"}.
  """
  known = np.asarray(known, np.float64)
  eval_steps = np.asarray(eval_steps, np.int64)
  eval_losses = np.asarray(eval_losses, np.float64)
  if eval_steps.shape != eval_losses.shape:
    raise ValueError(f"{eval_steps.size} evaluation steps but {eval_losses.size} losses.")
  steps = sim.steps_within(known, budget)
  order = np.argsort(eval_steps, kind="stable")
  eval_steps, eval_losses = eval_steps[order], eval_losses[order]
  inside = eval_steps <= steps  # a prefix of the readings in step order
  at = steps_to(eval_steps[inside], eval_losses[inside], target)
  out = {"steps": steps, "seconds": float(known[steps - 1]) if steps else 0.0,
         "time_to_target": None, "steps_to_target": None}
  if at is not None:
    out.update(time_to_target=clock_at(known, at), steps_to_target=at, stopped=REACHED)
  elif not np.any(inside & (eval_steps > 0)):
    out["stopped"] = NOT_EVALUATED
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
