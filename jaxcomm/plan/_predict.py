"""Predicted step time of a planned step on a network, and the bandwidth where methods cross.

The prediction is `jaxcomm.sim`'s clock, fed with the plan: each step's communication
seconds are the compiled step's collectives costed on the topology (`comm.cost`), charged
by the bytes the counters count at that step (`sim.comm_seconds_per_step`), and the run of
`StepPlan.steps` steps is simulated with the method's overlap (`sim.simulate`). The step
time is the simulated run's length over its steps, so a sync every H steps is paid once per
H steps, and what an overlapping schedule hides is not paid.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm import sim
from jaxcomm.plan._compile import StepPlan


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Seconds per step of a planned step on a topology (means over the planned steps)."""
  compute: float   # compute per step
  comm: float      # communication per step, all of it
  exposed: float   # communication per step that compute does not hide
  step: float      # the simulated run's length over its steps


def predict(step: StepPlan, topology: Any, compute_seconds: float, *, overlap_steps: int = 0,
            algorithm: str = "auto") -> Prediction:
  """Predicted seconds per step of `step` on `topology` (see the module docstring).

  Args:
    step: a `StepPlan` (`compile_step`).
    topology: a `comm.Topology`, `comm.Link`, link preset name or {mesh axis: link}.
    compute_seconds: compute per step (`compute_seconds(step.flops, device, mfu)`, or one
      measured).
    overlap_steps: later steps a sync overlaps (the method module's `overlap_steps`).
    algorithm: the collective algorithm charged (`comm.cost`).

  Returns:
    A `Prediction`.

  >>> import numpy as np
  >>> from jaxcomm import comm
  >>> ring = comm.Collective("all-reduce", "f32", (1000,), ("data",), 8, 4000, 7000, False, 1, "x")
  >>> step = StepPlan(comm.CollectiveReport((ring,)), None, 0.0, 0.0, {}, np.full(4, 7000.0),
  ...                 "", {"data": 8}, 4)
  >>> p = predict(step, comm.Link(1e9, 1e-5), 0.01, algorithm="ring")
  >>> round(p.comm, 9), round(p.step, 9)  # 14 latencies + 7 KB at 1 GB/s, after the compute
  (0.000147, 0.010147)
  """
  v.instance("step", step, StepPlan, "plan.StepPlan (from plan.compile_step)")
  compute_seconds = v.number("compute_seconds", compute_seconds, low=0)
  costs = comm.cost(step.report, topology, algorithm)
  comm_s = sim.comm_seconds_per_step(step.schedule, costs)
  timeline = sim.simulate(compute_seconds, comm_s, overlap_steps=overlap_steps)
  n = len(comm_s)
  return Prediction(compute=compute_seconds, comm=float(comm_s.mean()),
                    exposed=timeline.exposed_comm / n, step=timeline.total / n)


def crossover(method: Callable[[float], float], reference: Callable[[float], float], *,
              low: float = 1e6, high: float = 1e12, points: int = 97) -> float | None:
  """The bandwidth below which `method` is faster than `reference`.

  Both are step times as functions of a link's bandwidth (bytes/s). The answer is the
  largest bandwidth b in [low, high] such that `method` is faster at every bandwidth from
  `low` up to b: found on a log-spaced grid of `points` and refined by bisection to 0.1 %.

  Returns:
    The bandwidth (bytes/s); `math.inf` when `method` is faster over the whole range;
    None when it is not faster even at `low`.

  >>> # 1 s of compute and 8 GB against 0.3 s more and 1 GB: equal at 7 GB / 0.3 s.
  >>> b = crossover(lambda b: 1.3 + 1e9 / b, lambda b: 1.0 + 8e9 / b)
  >>> round(b / 1e9, 2)
  23.33
  """
  low = v.number("low", low, low=0, low_open=True)  # bandwidths, bytes/s
  high = v.number("high", high, low=0, low_open=True)
  if not low < high:
    raise ValueError(f"low ({low}) must be below high ({high}).")
  faster = lambda b: method(b) < reference(b)
  grid = np.geomspace(low, high, points)
  if not faster(grid[0]):
    return None
  slower = next((i for i, b in enumerate(grid) if not faster(b)), None)
  if slower is None:
    return math.inf
  lo, hi = grid[slower - 1], grid[slower]
  while hi / lo > 1.001:
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if faster(mid) else (lo, mid)
  return float(lo)
