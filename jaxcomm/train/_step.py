"""The step builder: pure functions of a `StepConfig` and a frozen `StateLayout`.

`make_init` and `make_step` return jitted programs; nothing is written to any object and the
step is traced once (its out_specs come from the layout; that one trace, which jit keeps for
the calls, is checked as it is made). `Program` holds them; `Trainer` is a facade over it.

The step donates the train state (`donate_argnums`, `StepConfig.donate`): the new state takes
the old one's buffers, so a model-sized state (DiLoCo's outer parameters, error memories) is
not held twice at the step's peak. A state passed to the step is consumed; keep the new one.

Populations (`StepConfig.trials`): the per-device step `jax.vmap`s one trial's local step
over the leading trial axis. Under vmap a `lax.cond` on a per-trial value becomes a select,
so both branches' collectives run every step: values and counted bytes stay exact per
trial, only the emulation does more work.

Meshes are built with `AxisType.Auto` axes (see `jaxcomm.parallel.make_mesh`): the classic
shard_map model, in which inputs are resharded to `in_specs` as needed.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P

from jaxcomm import comm
from jaxcomm import sync
from jaxcomm.train import _nnx
from jaxcomm.train import _validate
from jaxcomm.train._layout import StateLayout
from jaxcomm.train._layout import StepConfig
from jaxcomm.train._layout import stack
from jaxcomm.train._layout import unstack


class TrainState(NamedTuple):
  """Everything a run needs to continue: one Orbax save restores it exactly."""
  step: jax.Array   # i32[]: optimiser steps taken (one counter, shared by all trials)
  params: Any       # parameters; per-worker leaves carry a leading worker axis
  opt_state: Any    # optimiser state; per-worker leaves carry a leading worker axis
  # An NNX model's other variables (BatchNorm statistics, RNG stream keys) as a pure dict;
  # per-worker leaves carry a leading worker axis. None for a parameter tree.
  model_state: Any = None


def state_specs(config: StepConfig, layout: StateLayout) -> TrainState:
  """PartitionSpecs of the stored train state (worker and trial axes in front)."""
  model = None
  if layout.model_state is not None:
    model = config.stored(layout.model_state, layout.model_specs)
  return TrainState(step=P(), params=config.stored(layout.params, layout.param_specs),
                    opt_state=config.stored(layout.opt_state, layout.opt_specs),
                    model_state=model)


def make_init(config: StepConfig, layout: StateLayout) -> Callable:
  """The jitted `(params, model_state) -> TrainState` that starts a run.

  Per-worker leaves start equal on all workers and are stored once per worker; with
  `config.trials`, `optimizer.init` is vmapped over the trials. `model_state` is an NNX
  model's other variables (None for a parameter tree).

  >>> import jax.numpy as jnp, optax
  >>> from jaxcomm import local
  >>> from jaxcomm.parallel import make_mesh
  >>> from jaxcomm.train import StepConfig, derive_layout
  >>> config = StepConfig(lambda p, b: jnp.mean((b * p["w"]) ** 2),
  ...                     local.local_sgd(optax.sgd(0.1), 2), make_mesh({"data": 8}))
  >>> params = {"w": jnp.ones(3)}
  >>> state = make_init(config, derive_layout(config, params))(params, None)
  >>> state.params["w"].shape  # one row per worker
  (8, 3)
  """
  specs = state_specs(config, layout)
  in_specs = config.with_trials((layout.param_specs, layout.model_specs))

  def init_trial(params, model_state):
    opt_state = config.optimizer.init(params)
    trees = (params, opt_state, model_state)
    per_worker = (layout.params, layout.opt_state, layout.model_state)
    # Per-worker leaves start equal on all workers but are stored once per worker.
    return tuple(stack(jax.tree.map(lambda pw, x: comm.varying(x, config.lead_axes(pw)),
                                    pw_tree, tree), pw_tree)
                 for pw_tree, tree in zip(per_worker, trees))

  if config.trials is not None:
    init_trial = jax.vmap(init_trial)

  def init_local(params, model_state):
    params, opt_state, model_state = init_trial(params, model_state)
    # Computed, not device_put: on a mesh over every process, device_put of a host value
    # first checks with an all-gather that each process passed the same value, a collective
    # that jaxcomm.elastic cannot afford once a process has restarted.
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                      model_state=model_state)

  return jax.jit(jax.shard_map(init_local, mesh=config.mesh, in_specs=in_specs,
                               out_specs=specs))


def local_loss(config: StepConfig) -> Callable:
  """`(params, batch, model_state, step, key) -> (loss, (aux, model_state))` on one worker.

  Calls the user's loss in the form it was given: `loss_fn(params, batch)`, an NNX model
  merged from the parameters and variables (`loss_fn(model, batch)`), plus this step's and
  worker's key (`step_key(key, step, worker)`) when the config has one.
  """
  parts = config.nnx

  def loss(params, batch, model_state, step, key):
    worker = lax.axis_index(config.batch_axes)  # this worker's row of the batch
    extra = () if key is None else (_nnx.step_key(key, step, worker),)
    if parts is None:
      out = config.loss_fn(params, batch, *extra)
    else:
      model = _nnx.merge(parts, params, _nnx.reseed(parts, model_state, step, worker))
      out = config.loss_fn(model, batch, *extra)
      model_state = _nnx.updated(parts, model, model_state)
    value, aux = out if config.has_aux else (out, {})
    return value, (aux, model_state)
  return loss


def _sync_model_state(config: StepConfig, model_state) -> tuple[Any, float]:
  """With mutable="mean", the updated variables averaged over the batch axes (and bytes)."""
  if config.mutable != "mean" or model_state is None:
    return model_state, 0.0
  variables = config.nnx.is_variable()
  leaves = [x for var, x in zip(jax.tree.leaves(variables), jax.tree.leaves(model_state))
            if var]
  means, nbytes = comm.mean(leaves, config.batch_axes)
  means = iter(means)
  return jax.tree.map(lambda var, x: next(means) if var else x, variables,
                      model_state), nbytes


def _grad_measurements(config: StepConfig, layout: StateLayout, grads) -> dict:
  """Squared gradient norms per group of leaves varying over the same non-batch axes.

  Tensor-parallel shards, pipeline stages: `measurements` sums each group over its axes,
  so no collective is spent on the norm. Without such groups, the norm itself.
  """
  sums = dict.fromkeys(layout.grad_groups, 0.0)
  for g in jax.tree.leaves(grads):
    key = tuple(a for a in config.extra_axes if a in comm.varying_axes(g))
    sums[key] = sums[key] + jnp.sum(jnp.square(g.astype(jnp.float32)))
  if layout.grad_groups in (((),), ()):
    return {"grad_norm": jnp.sqrt(sums.get((), 0.0))}
  return {"grad_sq": [sums[k] for k in layout.grad_groups]}


def make_step(config: StepConfig, layout: StateLayout) -> Callable:
  """The jitted step `(state, batch) -> (state, per-device measurements, bytes sent)`.

  Per device, one worker differentiates the loss with respect to its own (varying) copy of
  the parameters, so the transform receives the *local* gradient and decides what travels.
  Measurements leave as one value per device, batch axes first (with trials: per trial,
  then per device); nothing is reduced over the non-batch axes inside the step. The bytes
  are those every device sent in this step (shape (trials,) with trials). With
  `config.donate` the step consumes the state passed to it.

  Nothing is traced here: jit traces the step at its first call (or `.trace`, `.lower`,
  `comm.inspect`) for those arguments' shapes and shardings, once, and keeps the trace. That
  trace is checked as it is made: every mesh axis the batch is split over must be crossed
  by a collective (`_validate.batch_axes_reduced`). The shard_map'ed step is traced to a
  jaxpr, checked, and that jaxpr is what the jitted step evaluates, so the loss and the
  transform are traced once.

  Args:
    config: the step's configuration.
    layout: the train state's layout (`derive_layout`).

  Returns:
    The jitted step, for a `TrainState` of `make_init` (or `jax.ShapeDtypeStruct`s with its
    shardings) and a global batch.

  Raises:
    ValueError (when traced): a batch mesh axis of size > 1 that no collective of the step
    crosses.

  >>> import jax.numpy as jnp, optax
  >>> from jaxcomm import sync
  >>> from jaxcomm.parallel import make_mesh
  >>> from jaxcomm.train import StepConfig, derive_layout, make_init
  >>> config = StepConfig(lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2),
  ...                     optax.chain(sync.mean("data"), optax.sgd(0.1)),
  ...                     make_mesh({"data": 8}))
  >>> params, batch = {"w": jnp.zeros(())}, {"x": jnp.ones(16), "y": 2 * jnp.ones(16)}
  >>> layout = derive_layout(config, params)
  >>> state = make_init(config, layout)(params, None)
  >>> state, per_device, sent = make_step(config, layout)(state, batch)
  >>> float(state.params["w"]), per_device["loss"].shape, int(sent)
  (0.4000000059604645, (8,), 7)
  """
  specs = state_specs(config, layout)
  loss_fn = local_loss(config)
  out_axes = config.batch_axes + config.extra_axes

  def trial_local(step, params, opt_state, model_state, batch_block, key):
    params = unstack(params, layout.params)
    opt_state = unstack(opt_state, layout.opt_state)
    model_state = unstack(model_state, layout.model_state)
    # Differentiate w.r.t. a varying copy: each worker gets its own local gradient.
    (loss, (aux, new_model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        comm.varying(params, config.batch_axes), batch_block, model_state, step, key)
    updates, new_opt = config.optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    sent = comm.counted_bytes(new_opt) - comm.counted_bytes(opt_state)
    new_model_state, model_bytes = _sync_model_state(config, new_model_state)
    new_model_state = jax.tree.map(
        lambda pw, x: comm.varying(x, config.batch_axes) if pw else x,
        layout.model_state, new_model_state)
    sent = comm.add_bytes(sent, model_bytes)
    measurements = {"loss": loss, **_grad_measurements(config, layout, grads), **aux}
    skipped = sync.skipped_steps(new_opt)
    if skipped is not None:  # steps skipped so far (sync.skip_nonfinite)
      measurements["skipped_steps"] = skipped
    measurements = jax.tree.map(lambda x: comm.varying(x, out_axes)[None], measurements)
    return (stack(new_params, layout.params), stack(new_opt, layout.opt_state),
            stack(new_model_state, layout.model_state), measurements, sent)

  if config.trials is not None:  # one local step per trial; the step counter is shared
    trial_local = jax.vmap(trial_local, in_axes=(None, 0, 0, 0, 0, 0))

  def step_local(state: TrainState, batch_block):
    params, opt_state, model_state, measurements, sent = trial_local(
        state.step, state.params, state.opt_state, state.model_state, batch_block, config.key)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                           model_state=model_state)
    return new_state, measurements, sent

  # One spec for every measurement (a prefix of their tree): nothing to trace for it; the
  # batch's spec is a prefix too unless `batch_specs` is a tree.
  m_spec = config.with_trials(P(out_axes))
  sharded = jax.shard_map(step_local, mesh=config.mesh,
                          in_specs=(specs, config.batch_specs_for(None)),
                          out_specs=(specs, m_spec, P()))

  def step(state, batch):
    # The one trace of the loss and the transform, checked, then evaluated into jit's trace.
    closed, out_shape = jax.make_jaxpr(sharded, return_shape=True)(state, batch)
    _validate.batch_axes_reduced(closed.jaxpr, config)
    out = jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves((state, batch)))
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)

  return jax.jit(step, donate_argnums=(0,) if config.donate else ())


def measurements(config: StepConfig, layout: StateLayout, per_device, sent=None) -> dict:
  """The step's measurements from the per-device ones that the step returns.

  Values are per worker (the batch axes) under `per_worker`, means over workers at the top
  level; with trials, every value has a leading trial axis. Over non-batch axes values are
  equal and taken once, except the squared gradient norms of leaves sharded over such axes
  (tensor parallelism), which are summed there.
  """
  extra = config.extra_axes
  lead = () if config.trials is None else (config.trials,)  # [trials,] workers, extra
  shape = (*lead, config.num_workers, *(config.mesh.shape[a] for a in extra))
  first = len(lead) + 1  # the first extra axis

  def reduce(x, sum_axes=()):
    x = x.reshape(shape)
    for i in reversed(range(len(extra))):
      x = x.sum(axis=first + i) if extra[i] in sum_axes else jnp.take(x, 0, axis=first + i)
    return x

  per_device = dict(per_device)
  grad_sq = per_device.pop("grad_sq", None)
  per_worker = jax.tree.map(reduce, per_device)
  if grad_sq is not None:
    per_worker["grad_norm"] = jnp.sqrt(sum(reduce(x, key)
                                           for x, key in zip(grad_sq, layout.grad_groups)))
  means = jax.tree.map(lambda x: jnp.mean(x, axis=len(lead)), per_worker)
  out = {**means, "per_worker": per_worker}
  if sent is not None:
    out["wire_bytes"] = sent
  return out
