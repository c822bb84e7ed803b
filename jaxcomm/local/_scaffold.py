"""SCAFFOLD: local steps corrected by control variates, the fix for client drift."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import comm
from jaxcomm.local import _core
from jaxcomm.local import _periodic


class ScaffoldState(NamedTuple):
  """State of `scaffold`."""
  count: jax.Array       # i32[]: updates taken
  inner_state: Any       # the inner optimiser's state (per-worker)
  control: Any           # like params: c_w, this worker's control variate (per-worker)
  global_control: Any    # like params: c = mean_w c_w (replicated)
  grad_sum: Any          # like params: sum of this round's local gradients (per-worker)
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)


def scaffold(inner: optax.GradientTransformation, sync_every: int,
             axis_name: comm.AxisName = "data", *,
             participation: _core.Participation = None) -> optax.GradientTransformationExtraArgs:
  """SCAFFOLD: each local step uses g_w − c_w + c; controls track the workers' gradients.

  Worker w steps its inner optimiser with the corrected gradient g_w − c_w + c, where c_w
  estimates its own gradient and c = mean_w c_w the global one, so a worker whose data is
  skewed does not drift towards its own optimum. At a sync (every H updates) the worker
  sets c_w⁺ = mean of its H local gradients of the round, which for inner SGD(lr) is exactly
  the paper's option II, c_w − c + (θ − θ_w)/(H·lr), and holds for any inner optimiser;
  then θ ← mean of the live θ_w and c ← c + (1/W) Σ_live (c_w⁺ − c_w), which keeps
  c = mean_w c_w when dropped workers keep their old c_w. One all-reduce of (θ, Δc) per
  sync: twice local SGD's bytes. The first round (c_w = c = 0) is plain local SGD.

  Read as gradient tracking across time (ST-GT), the controls make the local steps follow
  the global gradient, which is what the label-skew test checks against local SGD.

  Args:
    inner: the optimiser each worker runs (SGD in the paper).
    sync_every: H >= 1, local steps per round.
    axis_name: the mesh axis (or tuple of axes) of the workers; None for one device.
    participation: optional live-worker mask per sync (see `local_sgd`).

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Karimireddy et al., SCAFFOLD, arXiv 1910.06378; ST-GT, arXiv 2512.01732.

  >>> import jax.numpy as jnp, optax
  >>> tx = scaffold(optax.sgd(0.1), sync_every=2, axis_name=None)
  >>> params = {"w": jnp.zeros(2)}
  >>> state = tx.init(params)
  >>> for _ in range(2):
  ...   updates, state = tx.update({"w": jnp.ones(2)}, state, params)
  ...   params = optax.apply_updates(params, updates)
  >>> state.control["w"], params["w"]
  (Array([1., 1.], dtype=float32), Array([-0.2, -0.2], dtype=float32))
  """
  inner, sync_every, axis_name, live_fn = _core.schedule_args(inner, sync_every, axis_name,
                                                              participation)

  def init_fn(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return dict(control=zeros(), global_control=zeros(), grad_sum=zeros())

  def correct(updates, state, params):
    """g_w − c_w + c for the inner step; the round's sum of the raw gradients grows."""
    del params
    corrected = jax.tree.map(lambda g, cw, c: g - cw + c, updates, state.control,
                             state.global_control)
    return corrected, state._replace(grad_sum=jax.tree.map(jnp.add, state.grad_sum, updates))

  def end_round(local, state, sync):
    fresh = jax.tree.map(lambda s: s / sync_every, state.grad_sum)
    change = jax.tree.map(jnp.subtract, fresh, state.control)
    (total, change), nbytes = _core.masked_sum((local, change), sync.mine, axis_name)
    local = _core.live_mean_or_keep(total, sync.total, local)
    w = comm.axis_size(axis_name)
    return local, state._replace(
        global_control=jax.tree.map(lambda c, d: c + d / w, state.global_control, change),
        control=jax.tree.map(lambda f, c: jnp.where(sync.mine > 0, f, c), fresh,
                             state.control),
        grad_sum=jax.tree.map(jnp.zeros_like, state.grad_sum)), nbytes

  return _periodic.periodic(inner, sync_every, end_round, init_fn=init_fn,
                            state_type=ScaffoldState, axis_name=axis_name,
                            participation=live_fn, grad_fn=correct, name="scaffold")
