"""DES-LOC: local optimisation with separate sync periods for parameters and optimiser state."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.local import _core


class DesLocState(NamedTuple):
  """State of `des_loc`."""
  count: jax.Array       # i32[]: updates taken
  inner_state: Any       # the inner optimiser's state (per-worker between its syncs)
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)


def _field_of(path: tuple, names: Mapping[str, int]) -> str | None:
  """The outermost NamedTuple field on `path` that `names` lists, or None."""
  for entry in path:
    if isinstance(entry, jax.tree_util.GetAttrKey) and entry.name in names:
      return entry.name
  return None


def _check_periods(state_every: Any, sync_every: int) -> dict[str, int]:
  if state_every is None:  # the paper's Adam setting: K_u = 3 K_x, K_v = 6 K_x
    return {"mu": 3 * sync_every, "nu": 6 * sync_every}
  if not isinstance(state_every, Mapping) or not state_every or not all(
      isinstance(k, str) for k in state_every):
    raise ValueError(f"state_every must be a non-empty mapping from optimiser-state field "
                     f"names (e.g. 'mu', 'nu', 'trace') to sync periods, got {state_every!r}.")
  return {k: v.integer(f"state_every[{k!r}]", p, low=1, high=2**30)
          for k, p in state_every.items()}


def des_loc(inner: optax.GradientTransformation, sync_every: int,
            state_every: Mapping[str, int] | None = None, axis_name: comm.AxisName = "data",
            *, participation: _core.Participation = None
            ) -> optax.GradientTransformationExtraArgs:
  """DES-LOC: local steps; parameters averaged every K_x steps, each state class every K_c.

  Every worker runs `inner` on its own gradients. At update t the parameters are averaged
  over the workers (one all-reduce of |θ|) when t mod K_x = 0, and every leaf of the inner
  state that sits under the NamedTuple field `name` is averaged (one all-reduce of that
  class) when t mod state_every[name] = 0; averaging happens after the inner step of update
  t. State leaves under no listed field (step counts) are never sent. Each class is its own
  conditional branch, and bytes are counted there: per step on average
  |θ| b (1/K_x + Σ_c 1/K_c) times the all-reduce factor 2(W-1)/W.

  With every period 1 and a linear inner optimiser (SGD with momentum) this is exact data
  parallelism. With Adam it is not even at period 1: the averaged second moment is the mean of
  each worker's g_w², not the square of the mean gradient.

  Args:
    inner: the optimiser each worker runs (Adam in the paper; any optax transform).
    sync_every: K_x >= 1, steps between parameter averages.
    state_every: `{field name: period}` for the inner state's NamedTuple fields (optax's
      `ScaleByAdamState` has `mu` and `nu`, `TraceState` has `trace`); None is the paper's
      Adam setting `{"mu": 3 K_x, "nu": 6 K_x}`. A name found nowhere in the inner state
      raises ValueError at `init`.
    axis_name: the mesh axis (or tuple of axes) of the workers; None for one device.
    participation: optional live-worker mask per *update*: bool[num_updates, W] (row t − 1
      applies to every average taken at update t; rows past the end all live) or a
      traceable `fn(t - 1) -> bool[W]`. Each average (parameters or a state class) is over
      the live workers only, and every worker, live or not, takes it; the all-reduce and its
      bytes are unchanged.

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Iacob et al., DES-LOC: Desynced Low Communication Adaptive Optimizers, arXiv 2505.22549.

  >>> import jax.numpy as jnp, optax
  >>> tx = des_loc(optax.sgd(0.5, momentum=0.9), sync_every=2, state_every={"trace": 4},
  ...              axis_name=None)
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> updates["w"], int(state.count)
  (Array([-0.5, -0.5], dtype=float32), 1)
  """
  inner, sync_every, axis_name, live_fn = _core.schedule_args(inner, sync_every, axis_name,
                                                              participation)
  periods = _check_periods(state_every, sync_every)

  def classes(inner_state) -> dict[str, list[bool]]:
    """Per listed field, a mask over the inner state's leaves (ValueError if one is absent)."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(inner_state)[0]]
    fields = [_field_of(p, periods) for p in paths]
    missing = sorted(set(periods) - set(fields))
    if missing:
      found = sorted({e.name for p in paths for e in p
                      if isinstance(e, jax.tree_util.GetAttrKey)})
      raise ValueError(f"state_every names fields {missing} that the inner optimiser's "
                       f"state does not have; its fields are {found}.")
    return {name: [f == name for f in fields] for name in periods}

  def init_fn(params):
    inner_state = inner.init(params)
    classes(inner_state)  # a missing field fails here, before any step
    return DesLocState(count=jnp.zeros((), jnp.int32), inner_state=inner_state,
                       wire_bytes=comm.zero_bytes())

  def average_every(period, t, tree, wire):
    """Mean over the live workers of the leaves of `tree` when t mod period = 0."""
    def sync(tree, wire):
      mine, _, n_live = _core.live_weights(live_fn, t - 1, axis_name)
      avg, nbytes = _core.masked_average(tree, mine, n_live, axis_name)
      return avg, comm.add_bytes(wire, nbytes)
    return comm.cond(jnp.mod(t, period) == 0, sync, lambda *ops: ops, tree, wire)

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axis_name, "local.des_loc")
    _core.require_params(params, "des_loc")
    inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    local = optax.apply_updates(params, inner_updates)
    t = state.count + 1
    wire = state.wire_bytes
    leaves, treedef = jax.tree.flatten(inner_state)
    for name, mask in classes(inner_state).items():
      chosen = [x for x, m in zip(leaves, mask) if m]
      chosen, wire = average_every(periods[name], t, chosen, wire)
      chosen = iter(chosen)
      leaves = [next(chosen) if m else x for x, m in zip(leaves, mask)]
    local, wire = average_every(sync_every, t, local, wire)
    return _core.updates_to(local, params), DesLocState(
        t, jax.tree.unflatten(treedef, leaves), wire)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
