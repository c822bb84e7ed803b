"""Hierarchical local SGD: exact sync on a fast axis every step, averaging on a slow one."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.local import _core

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
  steps = None
  if worker_steps is not None:
    if not isinstance(worker_steps, (list, tuple, np.ndarray)) or not len(worker_steps):
      raise ValueError(f"worker_steps must be a non-empty list of integers, one per "
                       f"slow-axis worker; got {worker_steps!r}.")
    steps = np.asarray([v.integer("worker_steps", s, low=1, high=sync_every)
                        for s in worker_steps])
  phases = _core.Phases(sync_every, [0])

  def init_fn(params):
    return HierarchicalState(count=jnp.zeros((), jnp.int32), inner_state=inner.init(params),
                             wire_bytes=comm.zero_bytes())

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, comm.axis_names(fast_axis) + comm.axis_names(slow_axis),
                         "local.hierarchical")
    _core.require_params(params, "hierarchical")
    grads, fast_bytes = comm.mean(updates, fast_axis)
    inner_updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
    my_steps = jnp.ones((), jnp.float32)
    if steps is not None:
      _core.check_width("worker_steps", steps.size, slow_axis)
      my_steps = jnp.asarray(steps, jnp.float32)[_core.worker_index(slow_axis)]
      busy = jnp.mod(state.count, sync_every) < my_steps
      inner_updates = jax.tree.map(lambda u: jnp.where(busy, u, jnp.zeros_like(u)),
                                   inner_updates)
      inner_state = jax.tree.map(lambda n, o: jnp.where(busy, n, o), inner_state,
                                 state.inner_state)
    local = optax.apply_updates(params, inner_updates)
    t = state.count + 1

    def sync(local, wire):
      mine, row, n_live = _core.live_weights(live_fn, phases.sync_index(t), slow_axis)
      if weighting == "steps":
        all_steps = (jnp.asarray(steps, jnp.float32) if steps is not None
                     else jnp.ones_like(row))
        mine, n_live = mine * my_steps, jnp.sum(row * all_steps)
      avg, nbytes = _core.masked_average(local, mine, n_live, slow_axis)
      return avg, comm.add_bytes(wire, nbytes)

    wire = comm.add_bytes(state.wire_bytes, fast_bytes)
    local, wire = comm.cond(phases.slot(t) >= 0, sync, lambda *ops: ops, local, wire)
    return _core.updates_to(local, params), HierarchicalState(t, inner_state, wire)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
