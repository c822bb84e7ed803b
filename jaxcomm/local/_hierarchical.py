"""Hierarchical local SGD: exact sync on a fast axis every step, averaging on a slow one."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import optax

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.local import _core
from jaxcomm.local import _periodic

WEIGHTINGS = ("uniform", "steps")


class HierarchicalState(NamedTuple):
  """State of `hierarchical`."""
  count: jax.Array       # i32[]: updates taken
  inner_state: Any       # the inner optimiser's state (per slow-axis worker)
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent on both axes (mod 2**32)


def hierarchical(inner: optax.GradientTransformation, sync_every: int,
                 fast_axis: comm.AxisName = "fast", slow_axis: comm.AxisName = "slow", *,
                 worker_steps: Sequence[int] | None = None, weighting: str = "uniform",
                 participation: _core.Participation = None
                 ) -> optax.GradientTransformationExtraArgs:
  """DASO-style: all-reduce gradients on the fast axis every step, average on the slow one.

  Inside a group (the fast axis, e.g. the devices of one node) gradients are averaged
  exactly every step; the groups (the slow axis, e.g. datacenters) run local SGD and average
  their parameters every H steps. With `worker_steps`, slow worker w computes only
  worker_steps[w] of the H steps of each period (a slower site; it idles, state untouched,
  for the rest), and with `weighting="steps"` the average weights each worker by the steps it
  computed (WP-SGD). Bytes: one fast-axis all-reduce of the gradients per step, plus one
  slow-axis all-reduce of the parameters per sync (in the sync branch).

  Args:
    inner: the optimiser each group runs on its exactly averaged gradients.
    sync_every: H >= 1, steps between slow-axis averages.
    fast_axis: the mesh axis (or axes) reduced every step.
    slow_axis: the mesh axis (or axes) averaged every H steps.
    worker_steps: optional steps computed per period by each slow worker, each in [1, H].
    weighting: "uniform" or "steps" (WP-SGD: weight by worker_steps).
    participation: optional live mask of slow workers per sync (see `local_sgd`).

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`. Train it with the
    Trainer's `batch_axes=(slow_axis, fast_axis)` so the batch is split over both.

  References:
    DASO, arXiv 2104.05588; WP-SGD, arXiv 1708.04801; Lin et al., arXiv 1808.07217.

  >>> import jax.numpy as jnp, optax
  >>> tx = hierarchical(optax.sgd(1.0), sync_every=2, fast_axis=None, slow_axis=None)
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> updates["w"]
  Array([-1., -1.], dtype=float32)
  """
  inner, sync_every, slow_axis, live_fn = _core.schedule_args(inner, sync_every, slow_axis,
                                                              participation, "slow_axis")
  fast_axis = v.axis_name("fast_axis", fast_axis)
  weighting = v.one_of("weighting", weighting, WEIGHTINGS)
  steps = _core.check_worker_steps(worker_steps, sync_every)

  def fast_mean(updates, state, params):
    """The gradient averaged exactly over the fast axis, every step (bytes counted here)."""
    del params
    grads, nbytes = comm.mean(updates, fast_axis)
    return grads, state._replace(wire_bytes=comm.add_bytes(state.wire_bytes, nbytes))

  def average(local, state, sync):
    avg, nbytes = _core.masked_average(local, sync.mine, sync.total, slow_axis)
    return avg, state, nbytes

  tx = _periodic.periodic(inner, sync_every, average, state_type=HierarchicalState,
                          axis_name=slow_axis, participation=live_fn, worker_steps=steps,
                          worker_weights=steps if weighting == "steps" else None,
                          grad_fn=fast_mean, name="hierarchical")

  def update_fn(updates, state, params=None, **extra_args):
    # Each worker's own gradient, on both axes (the skeleton checks the slow one only).
    comm.require_varying(updates, comm.axis_names(fast_axis) + comm.axis_names(slow_axis),
                         "local.hierarchical")
    return tx.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)
