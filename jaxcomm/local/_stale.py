"""SGD on stale gradients (asynchronous SGD with a fixed delay), with DC-ASGD compensation."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import comm

COMPENSATIONS = (None, "dc")


class StaleState(NamedTuple):
  """State of `stale`."""
  count: jax.Array            # i32[]: updates taken
  past_params: optax.Params   # [delay, ...] per leaf: ring buffer of the last `delay`
                              # iterates; iterate s sits in slot s mod delay
  inner_state: optax.OptState  # state of the inner optimiser (it sees the current iterate)
  wire_bytes: jax.Array       # u32[]: cumulative bytes sent (mod 2**32)


def _check_dc_lambda(dc_lambda: Any) -> Any:
  """A finite number >= 0; a (possibly traced) jax array is taken as given."""
  return dc_lambda if isinstance(dc_lambda, jax.Array) else v.number("dc_lambda", dc_lambda,
                                                                     low=0)


def delay_compensation(grads: optax.Updates, params_now: optax.Params,
                       params_stale: optax.Params, dc_lambda: float | jax.Array
                       ) -> optax.Updates:
  """DC-ASGD's first-order correction of a gradient computed at stale parameters.

  g~ = g + dc_lambda * g * g * (theta_now - theta_stale): a Taylor step from the parameters the
  gradient was computed at to the ones it is applied to, with the Hessian approximated by
  the diagonal of the gradient's outer product (exact in expectation for log-likelihood
  losses, where the outer product of per-example gradients is the Fisher). Elementwise, so it
  applies to any delayed update: a stale gradient (`stale`) or a delayed outer gradient of a
  Streaming DiLoCo fragment (CoCoDC, arXiv 2504.17672), with theta_stale the fragment when
  its outer gradient was sent and theta_now the fragment when it arrives.

  Args:
    grads: the stale gradient (or delayed update) g.
    params_now: the parameters it is applied to.
    params_stale: the parameters it was computed at.
    dc_lambda: the variance-control weight lambda >= 0 (0 turns the correction off).

  Returns:
    The compensated gradient, in the dtype of `grads`.

  References:
    Zheng et al., Asynchronous SGD with Delay Compensation, arXiv 1609.08326.

  >>> import jax.numpy as jnp
  >>> delay_compensation(jnp.array([1.0, 2.0]), jnp.array([0.5, 0.5]), jnp.zeros(2), 0.1)
  Array([1.05, 2.2 ], dtype=float32)
  """
  dc_lambda = _check_dc_lambda(dc_lambda)

  def correct(g, now, old):
    shift = (now - old).astype(g.dtype)
    return g + jnp.asarray(dc_lambda, g.dtype) * g * g * shift

  return jax.tree.map(correct, grads, params_now, params_stale)


def stale(inner: optax.GradientTransformation, delay: int,
          axis_name: comm.AxisName = "data", compensation: str | None = None,
          dc_lambda: float = 0.04) -> optax.GradientTransformationExtraArgs:
  """Steps with gradients computed `delay` steps ago: asynchronous SGD with a fixed delay.

  Workers compute gradients at parameters `delay` updates old while the optimiser moves on,
  as in asynchronous SGD where every gradient arrives tau updates after the parameters it
  was computed at were read. The state keeps a ring buffer of the last `delay` iterates;
  the Trainer's parameters are the stale iterate theta_{t - delay} (theta_0 for t < delay), so
  the Trainer's gradient is the stale gradient, and the current iterate theta_t lives in the
  buffer (`state.past_params[count % delay]`). With `compensation="dc"` each worker corrects its
  own gradient with `delay_compensation` before the mean (DC-ASGD compensates every arriving
  gradient). One all-reduce of the gradient per step: 2(W-1)/W * |g| bytes. `delay=0` is
  exact data parallelism.

  Args:
    inner: the optimiser applied to the (compensated) mean stale gradient at the current
      iterate (the analysis assumes `optax.sgd`; any optimiser runs).
    delay: tau >= 0, the staleness in updates.
    axis_name: the data axis (or tuple of axes) to average over; None for one device.
    compensation: None, or "dc" for DC-ASGD delay compensation.
    dc_lambda: DC-ASGD's lambda >= 0 (0.04: the paper's constant-lambda setting, as recalled,
      unverified); unused without compensation.

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params`.

  References:
    Zheng et al., Asynchronous SGD with Delay Compensation, arXiv 1609.08326.

  >>> import jax.numpy as jnp, optax
  >>> tx = stale(optax.sgd(1.0), delay=1, axis_name=None)
  >>> p = {"w": jnp.ones(())}
  >>> state = tx.init(p)
  >>> u, state = tx.update({"w": jnp.ones(())}, state, p)  # theta_1 = 0, Trainer stays at theta_0
  >>> float(u["w"]), float(state.past_params["w"][0])
  (0.0, 0.0)
  """
  delay = v.integer("delay", delay, low=0)
  compensation = v.one_of("compensation", compensation, COMPENSATIONS)
  dc_lambda = _check_dc_lambda(dc_lambda)
  inner = optax.with_extra_args_support(v.transform("inner", inner))
  axis_name = v.axis_name("axis_name", axis_name)

  def init_fn(params):
    past = jax.tree.map(lambda x: jnp.broadcast_to(x, (delay, *jnp.shape(x))), params)
    return StaleState(count=jnp.zeros((), jnp.int32), past_params=past,
                      inner_state=inner.init(params), wire_bytes=comm.zero_bytes())

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axis_name, "local.stale")
    if params is None:
      raise ValueError("stale needs params: call update(grads, state, params).")
    # params: the stale iterate theta_{t - delay} the gradient was computed at.
    slot = state.count % max(delay, 1)
    now = params if delay == 0 else jax.tree.map(lambda b: b[slot], state.past_params)
    grads = updates
    if compensation == "dc":
      grads = delay_compensation(grads, now, params, dc_lambda)
    grads, nbytes = comm.mean(grads, axis_name)
    steps, inner_state = inner.update(grads, state.inner_state, now, **extra_args)
    wire = comm.add_bytes(state.wire_bytes, nbytes)
    if delay == 0:
      return steps, StaleState(state.count + 1, state.past_params, inner_state, wire)
    following = optax.apply_updates(now, steps)
    # The slot of theta_{t+1} holds theta_{t+1-delay}: the Trainer's next (stale) iterate.
    nxt = (state.count + 1) % delay
    stale_next = jax.tree.map(lambda b: b[nxt], state.past_params)
    past = jax.tree.map(lambda b, x: b.at[nxt].set(x.astype(b.dtype)), state.past_params,
                        following)
    moves = jax.tree.map(lambda s, p: (s - p).astype(p.dtype), stale_next, params)
    return moves, StaleState(state.count + 1, past, inner_state, wire)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
