"""Local SGD / FedAvg: H local steps, then average the parameters."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from jaxcomm import comm
from jaxcomm.local import _core
from jaxcomm.local import _periodic


class LocalSgdState(NamedTuple):
  """State of `local_sgd`."""
  count: jax.Array       # i32[]: updates taken
  inner_state: Any       # the inner optimiser's state (per-worker)
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)


def local_sgd(inner: optax.GradientTransformation, sync_every: int,
              axis_name: comm.AxisName = "data", *,
              participation: _core.Participation = None) -> optax.GradientTransformationExtraArgs:
  """Each worker takes `sync_every` steps of `inner` on its own data, then all average.

  On a sync step the returned updates move every worker to the mean of the live workers'
  parameters (after their own inner step): one all-reduce of the parameters every H steps,
  counted in the sync branch only. With H = 1 and inner SGD this is exact data parallelism
  (up to float rounding: the mean of `p - lr*g_w` instead of `p - lr*mean(g_w)`).

  Args:
    inner: the optimiser each worker runs locally (its state is kept across syncs).
    sync_every: H >= 1, local steps between averages.
    axis_name: the mesh axis (or tuple of axes) to average over; None for one device.
    participation: optional mask of live workers per sync, a bool[num_syncs, W] array (rows
      past the end: all live) or a traceable `fn(sync_index) -> bool[W]`. Dropped workers
      contribute nothing and continue from the average.

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    McMahan et al., arXiv 1602.05629; Stich, arXiv 1805.09767.

  >>> import jax.numpy as jnp, optax
  >>> tx = local_sgd(optax.sgd(0.5), sync_every=2, axis_name=None)
  >>> params = {"w": jnp.ones(2)}
  >>> state = tx.init(params)
  >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params)
  >>> optax.apply_updates(params, updates)["w"], int(state.count)
  (Array([0.5, 0.5], dtype=float32), 1)
  """
  inner, sync_every, axis_name, live_fn = _core.schedule_args(inner, sync_every, axis_name,
                                                              participation)

  def average(local, state, sync):
    avg, nbytes = _core.masked_average(local, sync.mine, sync.total, axis_name)
    return avg, state, nbytes

  return _periodic.periodic(inner, sync_every, average, state_type=LocalSgdState,
                            axis_name=axis_name, participation=live_fn,
                            name="local_sgd")
