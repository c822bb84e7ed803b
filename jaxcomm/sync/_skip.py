"""Skip a step whose gradient is not finite on any worker, leaving every state untouched.

Why a wrapper and not a check in the training loop: the decision has to be taken *inside* the
step, before anything stateful happens (an error memory absorbing a NaN is corrupted for
good; a DiLoCo outer step averaging a NaN poisons every worker), and the workers have to
agree on it, which takes a collective. A wrapper around the whole chain does both with the
same tools as every other stage: one 4-byte all-reduce through `jaxcomm.comm`, counted in its
state, then a conditional (`comm.cond`), so that a skipped step sends nothing else and
changes nothing (including the inner counters of schedules: a skipped step does not count as
a step of a sync period). optax's `apply_if_finite` decides per worker and keeps going on the
others, which would let per-worker and replicated state drift apart.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import comm

SKIPPED_FIELD = "skipped_steps"


class SkipNonfiniteState(NamedTuple):
  """State of `skip_nonfinite`."""
  inner_state: Any          # the wrapped transform's state, unchanged by a skipped step
  skipped_steps: jax.Array  # i32[]: steps skipped so far (the same on every worker)
  wire_bytes: jax.Array     # u32[]: bytes of the agreement all-reduce (mod 2**32)


def skip_nonfinite(inner: optax.GradientTransformation,
                   axis_name: comm.AxisName = "data") -> optax.GradientTransformationExtraArgs:
  """Runs `inner` only when every worker's gradient is finite; otherwise skips the step.

  Each worker checks its local gradient; one int32 all-reduce over `axis_name` counts the
  workers that saw a NaN or Inf (2(W-1)/W * 4 wire bytes every step). When the gradient is
  sharded (tensor or FSDP shards of a replica), the all-reduce also spans the axes its
  shards differ over, so that every device takes the same decision. If any did, the step
  returns zero updates and leaves `inner`'s state exactly as it was (error memories, outer
  parameters, counters, PRNG keys) and increments `skipped_steps`; `inner`'s own collectives
  run only in the taken branch. Wrap the whole chain, so that nothing stateful sees the
  gradient first.

  Args:
    inner: the transform to protect (e.g. `optax.chain(sync.mean("data"), optax.adam(1e-3))`).
    axis_name: the data axis (or tuple of axes) the workers agree over; None for one device.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `SkipNonfiniteState`.

  >>> import jax.numpy as jnp, optax
  >>> tx = skip_nonfinite(optax.sgd(1.0), axis_name=None)
  >>> state = tx.init({"w": jnp.ones(2)})
  >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, state)
  >>> updates["w"], int(state.skipped_steps)
  (Array([0., 0.], dtype=float32), 1)
  """
  inner = optax.with_extra_args_support(v.transform("inner", inner))
  axis_name = v.axis_name("axis_name", axis_name)

  def init_fn(params):
    return SkipNonfiniteState(inner_state=inner.init(params),
                              skipped_steps=jnp.zeros((), jnp.int32),
                              wire_bytes=comm.zero_bytes())

  def update_fn(updates, state, params=None, **extra_args):
    finite = jnp.asarray(True)
    for g in jax.tree.leaves(updates):
      finite = finite & jnp.all(jnp.isfinite(g))
    # Every device that holds other gradient values takes part in the decision: the
    # workers, and the devices holding other shards (tensor, fsdp), which must skip too.
    workers = () if axis_name is None else (
        tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,))
    axes = workers + tuple(sorted(comm.varying_axes(finite) - set(workers)))
    bad_workers, nbytes = comm.sum(jnp.logical_not(finite).astype(jnp.int32), axes or None)
    take = bad_workers == 0
    # The zero updates of a skipped step have the shapes and dtypes of the inner updates
    # (traced once more for its output types, without running it).
    out_updates = jax.eval_shape(inner.update, updates, state.inner_state, params,
                                 **extra_args)[0]

    def apply():
      return inner.update(updates, state.inner_state, params, **extra_args)

    def skip():
      return (jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out_updates),
              state.inner_state)

    # comm.cond: the inner update may vary over axes that the old state or zeros do not.
    new_updates, new_inner = comm.cond(take, apply, skip)
    return new_updates, SkipNonfiniteState(
        inner_state=new_inner,
        skipped_steps=state.skipped_steps + jnp.logical_not(take).astype(jnp.int32),
        wire_bytes=comm.add_bytes(state.wire_bytes, nbytes))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def skipped_steps(state: Any) -> jax.Array | None:
  """Total of every `skipped_steps` counter in an optimiser state; None when there is none.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = skip_nonfinite(optax.sgd(1.0), axis_name=None)
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> _, state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, state)
    >>> int(skipped_steps(state)), skipped_steps(optax.sgd(1.0).init({"w": jnp.ones(2)}))
    (1, None)
  """
  total = None
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if any(getattr(k, "name", None) == SKIPPED_FIELD for k in path):
      total = leaf if total is None else total + leaf
  return total

