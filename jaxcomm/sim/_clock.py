"""A run's simulated wall clock: compute per step plus the communication it cannot hide.

The simulation is a two-resource timeline. Each worker computes its steps one after another
(forward, backward and the optimiser step, `compute_seconds[t]`), and the network carries
one communication at a time (`comm_seconds[t]`, what step t sends, e.g. from `comm.cost`).
Step t's communication starts when its compute has ended and the network is free. A
schedule that overlaps communication with computation is described by how many later steps
may compute before they need it: with `overlap_steps = k`, the compute of step t + k + 1
waits for the communication of step t.

* k = 0: synchronous (exact data parallelism, compressed methods, DiLoCo's outer sync):
  the next step starts when the all-reduce has finished. This ignores the partial overlap
  of bucketed all-reduces with the backward pass (PyTorch DDP), so it is the conservative
  bound for those.
* k = 1: one-step delayed updates and ACCO: step t's gradients travel while step t + 1
  computes.
* k = tau: Streaming DiLoCo's overlapped outer sync, applied tau inner steps after it was
  sent (arXiv 2501.18512).

A method's k is a property of the method, not of the simulation: each experiment method
module says it (`overlap_steps` in experiments/methods/*.py).

A step is done when its compute and its own communication are both done. Its result is
*known* when it and every earlier step are done: with overlap a step that sends nothing can be
done before an earlier step's communication is, but the loss it reports is not the run's
until that communication has landed. `Timeline.known` is that clock, monotone by
construction: every time axis a loss is plotted or timed against (experiments/compare/,
the notebooks) is read from it, and the run of the first t steps takes `known[t - 1]`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jaxcomm import _validate as v
from jaxcomm import comm

@dataclasses.dataclass(frozen=True)
class Timeline:
  """When each step's compute and communication end (seconds from the start)."""
  compute_end: np.ndarray   # f64[T]
  comm_end: np.ndarray      # f64[T]: equals compute_end for a step that sends nothing
  compute_seconds: np.ndarray  # f64[T]
  comm_seconds: np.ndarray     # f64[T]

  @property
  def done(self) -> np.ndarray:
    """f64[T]: when step t's compute and its communication have both ended."""
    return np.maximum(self.compute_end, self.comm_end)

  @property
  def known(self) -> np.ndarray:
    """f64[T]: when step t's result is known: it and every earlier step are done.

    Monotone (non-decreasing), so a loss curve plotted against it runs forward in time, and
    `known[t - 1]` is the duration of a run of the first t steps. The clock to read losses
    against; `done` may run backwards where communication overlaps later steps.

    >>> t = simulate(0.1, [0.0, 0.5, 0.0, 0.0], overlap_steps=2)  # step 1's sync overlaps
    >>> t.done.round(6).tolist()   # steps 2 and 3 finish before step 1's sync lands
    [0.1, 0.7, 0.3, 0.4]
    >>> t.known.round(6).tolist()
    [0.1, 0.7, 0.7, 0.7]
    """
    return np.maximum.accumulate(self.done) if len(self.done) else self.done

  @property
  def total(self) -> float:
    """Seconds until every step, and everything it sent, is done (`known[-1]`)."""
    return float(self.known[-1]) if len(self.done) else 0.0

  @property
  def exposed_comm(self) -> float:
    """Seconds of the run spent waiting for the network (total minus compute)."""
    return self.total - float(self.compute_seconds.sum())


def _per_step(values: Any, steps: int | None, name: str) -> np.ndarray:
  arr = np.asarray(values, dtype=np.float64)
  if arr.ndim == 0:
    if steps is None:
      raise ValueError(f"{name} is a scalar: give comm_seconds per step to set the length.")
    arr = np.full(steps, float(arr))
  if arr.ndim != 1:
    raise ValueError(f"{name} must be a number or a 1-D sequence per step, got shape "
                     f"{arr.shape}.")
  if not np.all(np.isfinite(arr)) or np.any(arr < 0):
    raise ValueError(f"{name} must be finite and >= 0 seconds.")
  return arr


def simulate(compute_seconds: Any, comm_seconds: Sequence[float],
             overlap_steps: int = 0) -> Timeline:
  """Simulated timeline of a run (see the module docstring for the model).

  Args:
    compute_seconds: seconds of compute per step (a number, or one per step).
    comm_seconds: seconds of communication each step starts (0 for a step that sends
      nothing), e.g. from `comm_seconds_per_step`.
    overlap_steps: later steps that may compute while a step's communication is in flight
      (0 synchronous; see the module docstring).

  Returns:
    A `Timeline`.

  >>> t = simulate(0.1, [0.3, 0.3, 0.3])  # synchronous: (0.1 + 0.3) per step
  >>> t.done.round(6).tolist()
  [0.4, 0.8, 1.2]
  >>> round(simulate(0.1, [0.05] * 3, overlap_steps=1).total, 6)  # hidden but the last
  0.35
  """
  comm_s = _per_step(comm_seconds, None, "comm_seconds")
  compute_s = _per_step(compute_seconds, len(comm_s), "compute_seconds")
  if len(compute_s) != len(comm_s):
    raise ValueError(f"compute_seconds has {len(compute_s)} steps but comm_seconds has "
                     f"{len(comm_s)}.")
  k = v.integer("overlap_steps", overlap_steps, low=0)
  if k == 0:  # synchronous: each step starts when the previous one is done (a running sum)
    compute_end, comm_end = _synchronous(compute_s, comm_s)
    return Timeline(compute_end, comm_end, compute_s, comm_s)
  # The recurrence on Python floats (the same float64 arithmetic, without numpy's per-element
  # overhead: experiments/compare/ reads a growing timeline after every step).
  compute_end, comm_end = [], []
  free = 0.0      # when the network is next free
  previous = 0.0  # when the previous step's compute ended
  for t, (compute, comm_t) in enumerate(zip(compute_s.tolist(), comm_s.tolist())):
    needs = comm_end[t - k - 1] if t - k - 1 >= 0 else 0.0
    previous = max(previous, needs) + compute
    compute_end.append(previous)
    if comm_t > 0:
      free = max(free, previous) + comm_t
      comm_end.append(free)
    else:
      comm_end.append(previous)
  return Timeline(np.array(compute_end, np.float64), np.array(comm_end, np.float64),
                  compute_s, comm_s)


def _synchronous(compute_s: np.ndarray, comm_s: np.ndarray) -> tuple:
  """(compute_end, comm_end) of `overlap_steps=0`: step t computes from the end of step
  t - 1 (the network is free by then), so the ends are running sums, in the order the
  recurrence adds (compute, then communication)."""
  both = np.empty(2 * len(comm_s))
  both[0::2], both[1::2] = compute_s, comm_s
  ends = np.cumsum(both)  # sequential, so the sums are the recurrence's to the bit
  return ends[0::2], ends[1::2]


def comm_seconds_per_step(step_bytes: Sequence[float], comm_cost: comm.CommCost) -> np.ndarray:
  """Each step's communication seconds from the bytes it counted and a compiled step's cost.

  Collectives outside conditionals run every step and are charged in full. Collectives in
  conditional branches (a sync every H steps, a fragment of Streaming DiLoCo) are charged
  in proportion to the bytes the step sent beyond the every-step ones: a step that sends
  nothing extra pays none of them, a sync step pays all. With several branches that send
  different fragments, the bandwidth term stays exact and the latency term is shared out
  in proportion to bytes.

  Args:
    step_bytes: per-device wire bytes counted in state at each step (the Trainer's
      `wire_bytes` measurement).
    comm_cost: `comm.cost(comm.inspect(step_fn, state, batch), topology)`.

  Returns:
    f64[T] seconds.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxcomm import comm
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: comm.mean(x, "data")[0], mesh=mesh, in_specs=jax.P(),
    ...                   out_specs=jax.P())
    >>> report = comm.inspect(f, jnp.ones(1000), mesh=mesh)
    >>> costed = comm.cost(report, {"data": comm.Link(1e9, 1e-5)})
    >>> seconds = comm_seconds_per_step([7000.0, 7000.0], costed)
    >>> bool(np.allclose(seconds, costed.seconds()))  # an every-step all-reduce: paid each step
    True
  """
  step_bytes = np.asarray(step_bytes, dtype=np.float64)
  if step_bytes.ndim != 1 or not np.all(np.isfinite(step_bytes)) or np.any(step_bytes < 0):
    raise ValueError("step_bytes must be a 1-D sequence of finite byte counts >= 0.")
  v.instance("comm_cost", comm_cost, comm.CommCost, "comm.CommCost (from comm.cost)")
  every = comm_cost.seconds(conditional=False)
  every_bytes = comm_cost.wire_bytes(conditional=False)
  branch, branch_bytes = comm_cost.seconds(conditional=True), comm_cost.wire_bytes(
      conditional=True)
  if branch_bytes == 0:
    return np.full(len(step_bytes), every)
  # Counters round each addition to whole bytes: ignore differences below one byte each.
  extra = np.clip(step_bytes - every_bytes, 0.0, None)
  extra = np.where(extra < len(comm_cost), 0.0, extra)
  return every + branch * extra / branch_bytes
