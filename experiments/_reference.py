"""Exact data parallelism on the same mesh: what every "DP bytes / bytes" ratio is against.

A method's ratio compares the bytes it sends over the axes it synchronises (the `replica`
axis of a laid-out mesh, else the batch axes) with the bytes exact data parallelism sends
over the same axes on the same mesh, read from DP's compiled step (`jaxcomm.plan`). A
formula for unsharded DP would be wrong on a laid-out mesh: there each replica's gradient
is reduce-scattered over `fsdp` first, and what crosses `replica` is a shard of it. Traffic
inside a replica (ZeRO-3's gathers over `fsdp`, tensor-parallel activations) is the same for
every method and is left out of the ratio; the summary shows it per axis.

Both sides are means per step: a method that syncs every H steps is charged its sync's bytes
H times less often (its own counters say which steps sync).
"""

from __future__ import annotations

from typing import Any, Iterable

import jax

from . import build
from . import config as _config
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
