"""One-step delayed data parallelism (DPU): the all-reduce of step t overlaps step t + 1."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import comm


class DelayedState(NamedTuple):
  """State of `delayed`."""
  count: jax.Array          # i32[]: updates seen (0 before the first gradient)
  local_grads: optax.Updates  # this worker's gradient of the previous step (per worker)
  inner_state: optax.OptState  # state of the inner optimiser
  wire_bytes: jax.Array     # u32[]: cumulative bytes sent (mod 2**32)


def delayed(inner: optax.GradientTransformation,
            axis_name: comm.AxisName = "data") -> optax.GradientTransformationExtraArgs:
  """Applies the all-reduced gradient of step t at step t + 1.

  At step t each worker all-reduces the gradient it kept from step t - 1 and steps the inner
  optimiser with that mean, then keeps its new local gradient for the next step. The
  all-reduce's operand is state, not this step's backward, so the two have no data
  dependence and a scheduler may run the reduction while the next forward/backward runs
  (the "delayed parameter update" baseline). Step 0 has nothing to apply: it all-reduces the
  zero buffer and leaves the parameters and the inner state unchanged. The gradient of the
  last step is never applied. One all-reduce of the gradient per step, as in exact data
  parallelism: 2(W-1)/W * |g| bytes.

  In the compiled step (`comm.compiled_text`) the all-reduce reads only the buffer parameter.
  XLA:CPU (jaxlib 0.10) schedules it ahead of almost all of the forward and backward work
  but runs it synchronously, so on CPU nothing is hidden; the independence is what an
  asynchronous backend's latency-hiding scheduler needs.

  Args:
    inner: the optimiser that receives the (one step old) mean gradient.
    axis_name: the data axis (or tuple of axes); None for one device.

  Returns:
    An `optax.GradientTransformationExtraArgs`; its `local_grads` buffer is per worker.

  References:
    Ren et al., ZeRO-Offload, arXiv 2101.06840 (one-step delayed parameter update, DPU);
    Nabli et al., ACCO, arXiv 2406.02613 (DPU as the overlap baseline).

  >>> import jax.numpy as jnp, optax
  >>> tx = delayed(optax.sgd(1.0), axis_name=None)
  >>> state = tx.init({"w": jnp.zeros(2)})
  >>> u0, state = tx.update({"w": jnp.ones(2)}, state)
  >>> u1, state = tx.update({"w": 2 * jnp.ones(2)}, state)
  >>> u0["w"], u1["w"]
  (Array([0., 0.], dtype=float32), Array([-1., -1.], dtype=float32))
  """
  inner = optax.with_extra_args_support(v.transform("inner", inner))
  axis_name = v.axis_name("axis_name", axis_name)

  def init_fn(params):
    return DelayedState(count=jnp.zeros((), jnp.int32),
                        local_grads=jax.tree.map(jnp.zeros_like, params),
                        inner_state=inner.init(params), wire_bytes=comm.zero_bytes())

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axis_name, "local.delayed")
    # The previous step's local gradient travels; this step's is only stored.
    mean_grads, nbytes = comm.mean(state.local_grads, axis_name)
    new_updates, new_inner = inner.update(mean_grads, state.inner_state, params, **extra_args)
    ready = state.count > 0
    new_updates = jax.tree.map(lambda u: jnp.where(ready, u, jnp.zeros_like(u)), new_updates)
    new_inner = jax.tree.map(lambda n, o: jnp.where(ready, n, o), new_inner, state.inner_state)
    local = jax.tree.map(lambda g, b: g.astype(b.dtype), updates, state.local_grads)
    return new_updates, DelayedState(count=state.count + 1, local_grads=local,
                                     inner_state=new_inner,
                                     wire_bytes=comm.add_bytes(state.wire_bytes, nbytes))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
