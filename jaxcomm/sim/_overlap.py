"""One synchronous step whose gradient communication overlaps the backward pass, bucket by
bucket (PyTorch DDP's bucketed all-reduce, and any per-tensor compressed exchange that can
start as soon as its gradients exist).

The model (docs/algorithms.md, "Overlapped data parallelism"): the forward pass takes
`forward` seconds, then the backward pass `backward` seconds, during which the gradients
become ready in reverse layer order. The gradients are cut into buckets (in the order they
become ready); bucket b is ready when its last gradient is, taken as the backward pass's
share of the bytes produced so far (backward compute in proportion to parameter bytes).
Bucket b's communication starts when it is ready and the link is free (one collective at a
time), and takes `bucket_seconds[b]`. The optimiser's update (`optimizer` seconds) needs
every bucket, so it starts when the backward pass and the last bucket have both ended.
Exposed communication = finish of the last bucket - end of the backward pass (0 if it ends
sooner), and the step takes forward + backward + exposed + optimizer.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from jaxcomm import _validate as v


class BackwardOverlap(NamedTuple):
  """One step of `backward_overlap`: when each bucket is ready, starts and ends (seconds
  from the start of the step), the communication left after the backward pass, and the
  step's seconds."""
  ready: np.ndarray
  start: np.ndarray
  finish: np.ndarray
  exposed_comm: float
  step_seconds: float


def _seconds(value, name: str) -> float:
  return v.number(name, value, low=0.0)  # seconds


def backward_overlap(forward: float, backward: float, bucket_bytes: Sequence[float],
                     bucket_seconds: Sequence[float], optimizer: float = 0.0
                     ) -> BackwardOverlap:
  """A step whose buckets of gradients travel while the backward pass still runs.

  Args:
    forward: seconds of the forward pass.
    backward: seconds of the backward pass.
    bucket_bytes: bytes of each bucket, in the order the backward pass makes them (the last
      layer's first); they set when each bucket is ready.
    bucket_seconds: seconds each bucket's communication takes on the link (e.g.
      `comm.collective_time` of its share of the step's collectives).
    optimizer: seconds of the update after the last bucket has arrived.

  Returns:
    A `BackwardOverlap`. With every bucket free (infinite bandwidth, no latency) the step
    takes exactly its compute; with one bucket nothing overlaps (compute + communication).

  >>> o = backward_overlap(1.0, 2.0, [1, 1, 2], [1.0, 0.25, 1.0], optimizer=0.5)
  >>> o.ready.tolist(), o.finish.tolist()  # ready at 1 + 2 * (1/4, 2/4, 4/4)
  ([1.5, 2.0, 3.0], [2.5, 2.75, 4.0])
  >>> o.exposed_comm, o.step_seconds       # the last bucket ends 1 s after the backward
  (1.0, 4.5)
  """
  forward, backward = _seconds(forward, "forward"), _seconds(backward, "backward")
  optimizer = _seconds(optimizer, "optimizer")
  sizes = np.asarray(bucket_bytes, dtype=np.float64)
  times = np.asarray(bucket_seconds, dtype=np.float64)
  if sizes.ndim != 1 or sizes.size == 0 or not np.all(np.isfinite(sizes)) or \
     np.any(sizes < 0) or sizes.sum() <= 0:
    raise ValueError("bucket_bytes must be a non-empty 1-D sequence of finite byte counts "
                     ">= 0 with a positive sum.")
  if times.shape != sizes.shape or not np.all(np.isfinite(times)) or np.any(times < 0):
    raise ValueError(f"bucket_seconds must hold one finite time >= 0 per bucket "
                     f"({sizes.size}), got {times.tolist()}.")
  ready = forward + backward * np.cumsum(sizes) / sizes.sum()
  start, finish = np.zeros_like(ready), np.zeros_like(ready)
  free = 0.0  # when the link is next free
  for b, (r, t) in enumerate(zip(ready, times)):
    start[b] = max(r, free)
    finish[b] = free = start[b] + t
  end_backward = forward + backward
  exposed = max(0.0, float(finish[-1]) - end_backward)
  return BackwardOverlap(ready, start, finish, exposed, end_backward + exposed + optimizer)
