"""The skeleton of a local-update schedule: inner steps, then a sync every H updates.

`periodic` owns what every such schedule shares (the step count, the inner step, idle
masking of slower workers, participation and merge weights, the conditional sync, applying
the synchronised parameters as updates, the byte counter); a method supplies its sync rule
(`sync_fn`) and its own state (`init_fn`, and a NamedTuple class with its fields).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.local import _core

# The fields every periodic state has, and what the skeleton keeps in them.
OWN = ("count", "inner_state", "wire_bytes")


class PeriodicState(NamedTuple):
  """State of `periodic` without a state class of the method's own."""
  count: jax.Array       # i32[]: updates taken
  inner_state: Any       # the inner optimiser's state (per-worker)
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)
  key: Any = None        # u32[2]: PRNG key shared by all workers (None without `key=`)


class SyncInfo(NamedTuple):
  """What `periodic` tells `sync_fn` about the sync at hand (every leaf traced)."""
  t: jax.Array        # i32[]: this update's number, 1-based (t = count after it)
  index: jax.Array    # i32[]: k, the 0-based index of this sync among all syncs so far
  slot: jax.Array     # i32[]: which slot syncs (index into `offsets`; 0 with one slot)
  mine: jax.Array     # f32[]: this worker's weight in the sync (0: not live)
  weights: jax.Array  # f32[W]: every worker's weight (live mask x worker_weights)
  total: jax.Array    # f32[]: sum of `weights` (the live count without worker_weights)
  key: Any            # u32[2]: a fresh key of this sync, shared by all workers; or None


def _state_fields(state_type: Any, keyed: bool) -> tuple[str, ...]:
  """The method's own fields of `state_type` (ValueError if it is not a usable state class)."""
  fields = getattr(state_type, "_fields", None)
  if not (isinstance(state_type, type) and issubclass(state_type, tuple) and fields):
    raise ValueError(f"state_type must be a NamedTuple class, got {state_type!r}.")
  need = OWN + (("key",) if keyed else ())
  missing = [f for f in need if f not in fields]
  if missing:
    raise ValueError(f"state_type {state_type.__name__} must have the fields {list(need)} "
                     f"(`key` when a key is given); it lacks {missing}.")
  return tuple(f for f in fields if f not in OWN + ("key",))


def periodic(inner: optax.GradientTransformation, sync_every: int,
             sync_fn: Callable[[Any, Any, SyncInfo], tuple[Any, Any, float]], *,
             init_fn: Callable[[Any], Mapping[str, Any]] | None = None,
             state_type: type = PeriodicState, axis_name: comm.AxisName = "data",
             participation: _core.Participation = None,
             worker_steps: Sequence[int] | None = None,
             worker_weights: Sequence[float] | None = None,
             offsets: Sequence[int] = (0,), key: jax.Array | None = None,
             grad_fn: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None,
             after_fn: Callable[[Any, Any], tuple[Any, Any]] | None = None,
             name: str = "periodic") -> optax.GradientTransformationExtraArgs:
  """A local-update schedule from its sync rule: inner steps, a sync every `sync_every`.

  `periodic` owns what every such schedule shares; a method supplies its sync rule
  (`sync_fn`), its own state (`init_fn` and `state_type`) and, if it needs them, a gradient
  hook (`grad_fn`) and a hook after the sync (`after_fn`). Update t = count + 1 (1-based)
  runs, on every worker:

  1. `grad_fn(updates, state, params) -> (updates, state)`, if given, on every update: the
     gradient the inner optimiser sees (e.g. with a proximal or control-variate term), and
     the state (count = t - 1) with the method's own fields (and `wire_bytes`, for bytes it
     sends every step) replaced.
  2. The inner step: `local = params + inner.update(...)`. With `worker_steps`, worker r
     steps only when (t - 1) mod H < worker_steps[r] (a slower worker) and is idle
     otherwise: its parameters and inner state stay as they were.
  3. If slot s syncs at t (t mod H == offsets[s]), one conditional branch (`comm.cond`) runs
     `sync_fn(local, state, sync) -> (new_local, state, nbytes)` and adds `nbytes` to
     `state.wire_bytes`; otherwise nothing travels.
  4. `after_fn(local, state) -> (local, state)`, if given, on every update (state: count = t,
     after this update's sync): e.g. the merge of a fragment that synced τ updates ago
     (Streaming DiLoCo's overlap), in a conditional of its own.
  5. The returned updates move every worker to its final `local` (`local` of step 2 when
     nothing changed it); the state has count = t.

  The contract of `sync_fn(local, state, sync)`:

  * `local`: this worker's parameters after the inner step of update t (per worker).
  * `state`: the schedule's state, a `state_type` with count = t, the inner state after this
    update, and the method's own fields as the last update (or `grad_fn`) left them.
  * `sync`: a `SyncInfo`: `t`; `index`, k, the 0-based index of this sync among the syncs
    of every slot so far (what a participation mask is indexed by); `slot`, s; the weights
    of this sync, `mine` (this worker's), `weights` (all W) and `total` (their sum), each
    worker's weight being its participation entry of sync k (1 live, 0 dropped) times its
    `worker_weights` entry; `key`, a fresh PRNG key shared by all workers (None without
    `key=`).
  * It returns the parameters this worker continues from (the structure and dtypes of
    `local`; a dropped worker continues from them too unless the rule says otherwise), the
    state with only its own fields and `wire_bytes` replaced (`state._replace(...)`;
    count, inner_state and key belong to the schedule, and changing one is a ValueError),
    and the wire bytes it sent, a Python number (every `jaxcomm.comm` function returns
    them). Bytes sent in a branch of its own (`comm.switch`) it adds to `state.wire_bytes`
    in that branch and returns 0.
  * It runs inside the conditional, on every worker at once: it communicates through
    `jaxcomm.comm` over `axis_name`; `masked_average(tree, sync.mine, sync.total, axis)` and
    `masked_sum` are the live-weighted all-reduces.

  The state is `state_type(count, inner_state, wire_bytes, [key], **init_fn(params))`:
  `init_fn(params)` returns `{field: initial value}` for the method's own fields (a field
  with a default may be left out). A method with state of its own defines a NamedTuple with
  the fields `count`, `inner_state`, `wire_bytes` (and `key` if it passes one) and its own,
  so its state reads `state.outer_params`. The Trainer stores a leaf per worker when it
  varies over `axis_name` after an update (an error memory, a worker's momentum) and once
  when it does not (outer parameters computed from an all-reduce), and checkpoints and
  elastic runs keep both kinds exactly.

  Args:
    inner: the optimiser each worker runs between syncs (its state persists).
    sync_every: H >= 1, the period.
    sync_fn: the sync rule, `(local, state, SyncInfo) -> (new_local, state, nbytes)`.
    init_fn: `params -> {field: value}` of the method's own fields; None: it has none.
    state_type: the state's NamedTuple class (default `PeriodicState`).
    axis_name: the mesh axis (or tuple of axes) of the workers; None for one device.
    participation: optional live-worker mask per sync: bool[num_syncs, W] (rows past the end
      all live) or a traceable `fn(sync_index) -> bool[W]`.
    worker_steps: optional inner steps H_r in [1, H] per worker (idle for the rest of each
      period).
    worker_weights: optional weight > 0 per worker, multiplying the live mask in
      `SyncInfo.weights` (e.g. the tokens a worker processed per period).
    offsets: the slots' offsets, distinct integers in [0, H): slot s syncs when
      t mod H == offsets[s] (fragments, groups of layers); default one slot at 0.
    key: a PRNG key kept in `state.key` and split at every sync (one half to
      `SyncInfo.key`); None: no key.
    grad_fn: optional `(updates, state, params) -> (updates, state)`, run on every update
      before the inner step (a correction of the gradient; an exact mean over a fast axis).
    after_fn: optional `(local, state) -> (local, state)`, run on every update after the
      sync; like `grad_fn`, it may replace the method's own fields and `wire_bytes` only.
    name: the method's name in error messages ("local.<name> needs ...").

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`; extra
    arguments go to `inner`.

  Local SGD, DiLoCo (so SparseLoCo and MuLoCo), SCAFFOLD, NoLoCo, DreamDDP, Streaming
  DiLoCo, CoCoDC and the hierarchical schedule are written on it. Local SGD, averaging every
  2 updates, on one device:

  >>> import jax, jax.numpy as jnp, optax
  >>> from jaxcomm import local
  >>> def average(params, state, sync):
  ...   mean, nbytes = local.masked_average(params, sync.mine, sync.total, None)
  ...   return mean, state, nbytes
  >>> tx = local.periodic(optax.sgd(0.5), 2, average, axis_name=None)
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> updates["w"], int(state.count), int(state.wire_bytes)
  (Array([-0.5, -0.5], dtype=float32), 1, 0)

  With state of its own: outer parameters θ_out and an outer momentum v (v ← 0.9 v + Δ,
  Δ = θ_out − mean_w θ_w; θ_out ← θ_out − v), syncing every update:

  >>> from typing import Any, NamedTuple
  >>> class MomentumState(NamedTuple):
  ...   count: Any
  ...   inner_state: Any
  ...   wire_bytes: Any
  ...   outer_params: Any  # θ_out, like params (replicated)
  ...   velocity: Any      # v, like params (replicated)
  >>> def outer_momentum(params, state, sync):
  ...   mean, nbytes = local.masked_average(params, sync.mine, sync.total, None)
  ...   v = jax.tree.map(lambda o, m, u: 0.9 * u + (o - m), state.outer_params, mean,
  ...                    state.velocity)
  ...   new = jax.tree.map(jnp.subtract, state.outer_params, v)
  ...   return new, state._replace(outer_params=new, velocity=v), nbytes
  >>> tx = local.periodic(optax.sgd(0.5), 1, outer_momentum, state_type=MomentumState,
  ...                     init_fn=lambda p: {"outer_params": p,
  ...                                        "velocity": jax.tree.map(jnp.zeros_like, p)},
  ...                     axis_name=None)
  >>> state = tx.init(params)
  >>> for _ in range(2):
  ...   updates, state = tx.update({"w": jnp.ones(2)}, state, params)
  ...   params = optax.apply_updates(params, updates)
  >>> params["w"], state.velocity["w"]  # 1 - 0.5, then 0.5 - (0.9 * 0.5 + 0.5)
  (Array([-0.45, -0.45], dtype=float32), Array([0.95, 0.95], dtype=float32))
  """
  inner, sync_every, axis_name, live_fn = _core.schedule_args(inner, sync_every, axis_name,
                                                              participation)
  sync_fn = v.callable_("sync_fn", sync_fn)
  init_fn = v.callable_("init_fn", init_fn, allow_none=True)
  grad_fn = v.callable_("grad_fn", grad_fn, allow_none=True)
  after_fn = v.callable_("after_fn", after_fn, allow_none=True)
  steps = _core.check_worker_steps(worker_steps, sync_every)
  weights = _core.check_worker_weights(worker_weights)
  phases = _core.Phases(sync_every, _core.check_offsets(offsets, sync_every))
  keyed = key is not None
  key = v.key("key", key) if keyed else None
  fields = _state_fields(state_type, keyed)
  where = f"local.{name}"

  def init(params):
    own = dict(init_fn(params)) if init_fn is not None else {}
    unknown = sorted(set(own) - set(fields))
    if unknown:
      raise ValueError(f"{name}: init_fn returned fields {unknown} that "
                       f"{state_type.__name__} does not have (its own fields: "
                       f"{list(fields)}).")
    extra = {"key": key} if keyed else {}
    return state_type(count=jnp.zeros((), jnp.int32), inner_state=inner.init(params),
                      wire_bytes=comm.zero_bytes(), **extra, **own)

  def check_owned(who, before, after):
    """ValueError unless `after` is `before` with only the method's fields replaced."""
    if type(after) is not type(before):
      raise ValueError(f"{name}: {who} must return its state as a {type(before).__name__} "
                       f"(state._replace(...)), got {type(after).__name__}.")
    changed = [f for f in ("count", "inner_state", "key")
               if f in before._fields and getattr(after, f) is not getattr(before, f)]
    if changed:
      raise ValueError(f"{name}: {who} changed {changed}, which belong to the schedule; it "
                       f"may replace only its own fields {list(fields)} and wire_bytes.")

  def live(k):
    """(mine, weights, total) of sync k: the participation row times worker_weights."""
    mine, row, total = _core.live_weights(live_fn, k, axis_name)
    if weights is None:
      return mine, row, total
    _core.check_width("worker_weights", weights.size, axis_name)
    row = row * jnp.asarray(weights, jnp.float32)
    return row[_core.worker_index(axis_name)], row, jnp.sum(row)

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axis_name, where)
    _core.require_params(params, name)
    if grad_fn is not None:
      before = state
      updates, state = grad_fn(updates, state, params)
      check_owned("grad_fn", before, state)
    inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    if steps is not None:  # an idle worker's parameters and inner state stay as they were
      _core.check_width("worker_steps", steps.size, axis_name)
      mine = jnp.asarray(steps, jnp.int32)[_core.worker_index(axis_name)]
      busy = jnp.mod(state.count, sync_every) < mine
      inner_updates = jax.tree.map(lambda u: jnp.where(busy, u, jnp.zeros_like(u)),
                                   inner_updates)
      inner_state = jax.tree.map(lambda n, o: jnp.where(busy, n, o), inner_state,
                                 state.inner_state)
    local = optax.apply_updates(params, inner_updates)
    t = state.count + 1
    state = state._replace(count=t, inner_state=inner_state)
    carried = fields + (("key",) if keyed else ()) + ("wire_bytes",)

    def sync(local, *values):
      before = state._replace(**dict(zip(carried, values)))
      k = phases.sync_index(t)
      mine, row, total = live(k)
      sub = None
      if keyed:
        new_key, sub = jax.random.split(before.key)
        before = before._replace(key=new_key)
      new_local, after, nbytes = sync_fn(local, before, SyncInfo(
          t, k, phases.slot(t), mine, row, total, sub))
      check_owned("sync_fn", before, after)
      after = after._replace(wire_bytes=comm.add_bytes(after.wire_bytes, nbytes))
      return (new_local, *(getattr(after, f) for f in carried))

    local, *values = comm.cond(phases.slot(t) >= 0, sync, lambda *ops: ops, local,
                               *(getattr(state, f) for f in carried))
    state = state._replace(**dict(zip(carried, values)))
    if after_fn is not None:
      before = state
      local, state = after_fn(local, state)
      check_owned("after_fn", before, state)
    return _core.updates_to(local, params), state

  return optax.GradientTransformationExtraArgs(init, update_fn)
