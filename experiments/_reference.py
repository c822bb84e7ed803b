"""Exact data parallelism on the same mesh: what every "DP bytes / bytes" ratio is against.

A method's ratio compares the bytes it sends over the axes it synchronises (the `replica`
axis of a laid-out mesh, else the batch axes) with the bytes exact data parallelism sends
over the same axes on the same mesh, read from DP's compiled step (`jaxcomm.plan`). A
formula for unsharded DP would be wrong on a laid-out mesh: there each replica's gradient
is reduce-scattered over `fsdp` first, and what crosses `replica` is a shard of it. Traffic
inside a replica (ZeRO-3's gathers over `fsdp`, tensor-parallel activations) is the same for
every method and is left out of the ratio; the summary shows it per axis.

Both sides are means per step: a method that syncs every H steps is charged its sync's bytes
H times less often (its own counters say which steps sync). Over a run's own steps that
depends on where the run stops (40 steps of H = 30 hold one sync in 40 steps, not one in 30),
so the ratio is also given in the steady state: over a whole number of the periods with
which the counted bytes repeat (`steady_state`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax
import numpy as np

from . import build
from . import config as _config
from . import methods
from jaxcomm import plan


def axis_bytes(step: Any, axes: Iterable[str]) -> float:
  """Mean bytes per device per step of a `jaxcomm.plan.StepPlan`'s collectives whose
  groups span any of `axes`."""
  axes = set(axes)
  return float(sum(b for a, b in step.bytes_per_axis().items() if axes & set(a)))


def step_plan(config, devices=None, steps: int = 1):
  """(`jaxcomm.plan.StepPlan` of `config`'s step, compiled for abstract inputs, its Run)."""
  run = build.build(config, devices, abstract=True)
  return plan.compile_step(run.program(), run.params, global_batch(run.batches(0)),
                           steps=steps), run


def global_batch(share: Any) -> Any:
  """The global batch's shapes from this process's share (`Run.batches`): the processes'
  shares stacked along the batch axis, as `Trainer.shard_batch` assembles them."""
  n = jax.process_count()
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] * n, *x.shape[1:]), x.dtype),
                      share)


def dp_config(config):
  """`config` with exact data parallelism (`dp`) for its method: same mesh, model, data and
  inner optimiser."""
  return _config.with_method(config, {"method": "dp"})


def dp_bytes(config, axes: Iterable[str], devices=None) -> float:
  """Mean bytes per device per step that exact DP sends over `axes` on `config`'s mesh."""
  return axis_bytes(step_plan(dp_config(config), devices)[0], axes)


def horizon(config, steps_done: int) -> int:
  """Steps of counted bytes to plan: the run's, and enough for a steady state, 16 of the
  method's sync periods (its `period` hook) up to 4096 (the counter machine is one
  `lax.scan`: a longer one costs little)."""
  period = int(methods.hooks(config.method.name).period(config.method))
  return max(2 * steps_done, 256, min(16 * period, 4096))


def sync_period(schedule) -> int | None:
  """The smallest p with which the second half of `schedule` (bytes per step) repeats, at
  least twice; None when it does not (the schedule has not settled).

  >>> sync_period([5, 0, 0, 9, 0, 0, 9, 0, 0, 9, 0, 0])  # a warm-up, then 3-step periods
  3
  >>> sync_period([1, 2, 3, 4]) is None
  True
  """
  half = np.asarray(schedule, dtype=np.float64)[len(schedule) // 2:]
  for p in range(1, len(half) // 2 + 1):
    if np.array_equal(half[p:], half[:-p]):
      return p
  return None


def steady_state(step: Any, steps_done: int) -> tuple[Any, Any, int | None]:
  """(the run's StepPlan, the steady state's, its period in steps) from a StepPlan planned
  over more steps than the run's: the run's covers its first `steps_done` steps; the steady
  state's the last whole periods of the second half of the schedule (None, None when it
  does not repeat). A step without conditional collectives sends the same at every step:
  both are `step`, period 1."""
  if step.counted is None:
    return step, (step if not step.report.wire_bytes(conditional=True) else None), \
        (1 if not step.report.wire_bytes(conditional=True) else None)
  counted = step.counted
  n = max(1, min(steps_done, len(counted)))
  run = dataclasses.replace(step, counted=counted[:n], steps=n)
  period = sync_period(counted)
  if period is None:
    return run, None, None
  whole = (len(counted) // 2) // period * period
  window = counted[len(counted) - whole:]
  return run, dataclasses.replace(step, counted=window, steps=whole), period
