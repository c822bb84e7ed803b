"""`Trainer`: a convenience facade over the pure step builder (`derive_layout`, `make_init`,
`make_step`). It builds a `StepConfig`, derives the layout when `init` sees the parameters and
keeps the compiled programs; everything it computes comes from those three functions."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from jaxcomm.train import _nnx
from jaxcomm.train import _step
from jaxcomm.train import _validate
from jaxcomm.train._layout import StateLayout
from jaxcomm.train._layout import StepConfig
from jaxcomm.train._layout import derive_layout
from jaxcomm.train._step import TrainState

# Read through to the StepConfig (`trainer.mesh`, `trainer.axes`, ...).
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(StepConfig)) | {"num_workers"}


class Trainer:
  """Builds and runs a data-parallel training step with any optax transform.

  The loss is `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux=True`),
  computed on one worker's share of the batch. Inside the step each worker differentiates
  with respect to its own copy of the parameters, so the transform receives the *local*
  gradient and decides what travels (`jaxcomm.sync.mean` for exact data parallelism).

  Args:
    loss_fn: the per-worker loss.
    optimizer: an `optax.GradientTransformation` (e.g. `optax.chain(sync.mean("data"),
      optax.adamw(1e-3))`).
    mesh: the device mesh (see `jaxcomm.parallel.make_mesh`).
    axis_name: the data axis (or tuple of axes) the batch is split over.
    param_specs: optional PartitionSpecs of the parameters (tensor-parallel shards and
      pipeline stages over non-data axes, ZeRO-3 shards over a data axis); replicated by
      default. Optimiser-state leaves that mirror a parameter (same tree path suffix and
      shard shape: Adam's mu and nu, ...) get its spec.
    has_aux: whether `loss_fn` returns `(loss, aux)`; aux leaves are reported per worker.
    batch_specs: optional PartitionSpecs of the batch leaves (e.g. `P("data", "sequence")`
      for tokens split over a sequence axis); by default the leading dimension is split
      over the data axes.
    key: opt in to randomness in the loss: a PRNG key (`jax.random.key(seed)`); the loss is
      then called `loss_fn(params, batch, key)` with `step_key(key, step, worker)`, a key
      per step and worker (a pure function of them, so a resumed run draws the same).
    mutable: how an NNX model's mutable variables (BatchNorm statistics) are kept:
      "per_worker" (default: each worker's from its own batches, stored with a leading
      worker axis; nothing is sent) or "mean" (averaged over the data axes after every
      step, replicated; the all-reduce is counted in `wire_bytes`).
    donate: donate the train state to the step (its buffers are reused for the new state;
      the state passed to `step` is then consumed). True by default.
    trials: a population of this many independent trials in one program (None: one run).
      Every leaf of params, opt_state, model_state and the batch then carries a leading
      trial axis of that size (unsharded: every device holds all trials); the per-device
      step `jax.vmap`s the local step over it and `init` vmaps `optimizer.init`. The
      `step` counter stays one shared scalar; measurements gain a leading trial axis and
      `wire_bytes` has shape (trials,). `init` takes parameters already stacked over the
      trials (e.g. `jax.vmap(model.init)(keys)`); `key`, when given, is one typed key per
      trial (shape (trials,)); `param_specs` and `batch_specs` describe one trial. Give each
      trial its own codec keys with `fold_in_trials`. Under vmap a `lax.cond` on a per-trial
      value (a schedule's "sync this step?" once trials disagree, or a skip of a non-finite
      step) becomes a select, so both branches' collectives run every step: values and
      counted bytes stay exact per trial, only the emulation does more work.

  NNX models: `init(model)` takes an `nnx.Module` and the loss is then
  `loss_fn(model, batch)` (plus `key` when given). The parameters (`nnx.Param`) become a
  plain dict, what the optimiser and the collectives see (laid out like a linen model's);
  the other variables become `TrainState.model_state`; RNG streams are reseeded every step
  with `step_key(stream key, step, worker)` (see `jaxcomm.train._nnx`). `model(state)`
  gives the trained model back.

  The configuration is `trainer.config` (a `StepConfig`; its fields read through, e.g.
  `trainer.mesh`), the layout `trainer.layout` once `init` has seen the parameters.

  >>> import jax.numpy as jnp, optax
  >>> from jaxcomm import sync
  >>> from jaxcomm.parallel import make_mesh
  >>> mesh = make_mesh({"data": 8})
  >>> loss = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
  >>> trainer = Trainer(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh)
  >>> state = trainer.init({"w": jnp.zeros(())})
  >>> batch = {"x": jnp.ones(16), "y": 2 * jnp.ones(16)}
  >>> state, m = trainer.step(state, batch)
  >>> float(state.params["w"]), int(m["wire_bytes"])
  (0.4000000059604645, 7)
  """

  def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation,
               mesh: jax.sharding.Mesh, *, axis_name: str | tuple = "data",
               param_specs: Any = None, has_aux: bool = False, batch_specs: Any = None,
               key: jax.Array | None = None, mutable: str = "per_worker",
               donate: bool = True, trials: int | None = None):
    self.config = StepConfig(loss_fn, optimizer, mesh, axes=axis_name,
                             param_specs=param_specs, has_aux=has_aux,
                             batch_specs=batch_specs, key=key, mutable=mutable, donate=donate,
                             trials=trials)
    self._built = None  # (shapes, layout, init program) of the parameters init last saw
    self._step_fn = None
    self._measure = jax.jit(self.measurements)
    # XLA:CPU can deadlock in an all-reduce rendezvous when executions of a collective
    # program overlap across emulated devices: a device runs step t + 1 into a collective
    # while others still wait for a thread for step t (seen with jaxlib 0.10.2 whenever the
    # collective comes first in the program, e.g. `local.delayed`). One step at a time.
    self._sync_each_step = all(d.platform == "cpu" for d in mesh.devices.flat)

  def __getattr__(self, name: str) -> Any:
    if name in _CONFIG_FIELDS:
      return getattr(self.config, name)
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  @property
  def axis_name(self) -> str | tuple:
    axes = self.config.axes
    return axes[0] if len(axes) == 1 else axes

  @property
  def layout(self) -> StateLayout:
    if self._built is None:
      raise ValueError("call init(params) before asking for the layout.")
    return self._built[1]

  # ---------------------------------------------------------------- init and step
  def init(self, params) -> TrainState:
    """The initial train state from the (replicated) initial parameters or an NNX model.

    The layout is derived the first time (and again for parameters of other shapes or
    another NNX model); the compiled programs are kept for the same shapes.

    Args:
      params: a parameter tree, or an `nnx.Module` (split into its parameters, which the
        optimiser sees, and its other variables, `TrainState.model_state`). With `trials`,
        every leaf carries a leading trial axis (e.g. `jax.vmap(model.init)(keys)`).
    """
    model_state = None
    if _nnx.is_module(params):
      parts, params, model_state = _nnx.split(params)
      _validate.mutable_state(self.config.mutable, model_state, parts.is_variable())
      self.config = dataclasses.replace(self.config, nnx=parts)
      self._built = None  # the step merges this model's graph
    _validate.trial_axis("params", params, self.config.trials)
    _validate.trial_axis("model_state", model_state, self.config.trials)
    shapes = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), (params, model_state))
    if self._built is None or self._built[0] != shapes:
      layout = derive_layout(self.config, params, model_state)
      self._built = (shapes, layout, _step.make_init(self.config, layout))
      self._step_fn = None
      self._measure = jax.jit(self.measurements)
    return self._built[2](params, model_state)

  def model(self, state: TrainState, worker: int = 0) -> Any:
    """The trained NNX model: worker `worker`'s parameters and variables merged again.

    Call `.eval()` on it before evaluating (BatchNorm's running averages, no dropout).
    With `trials`, the model's arrays carry the leading trial axis.
    """
    if self.config.nnx is None:
      raise ValueError("model() needs a Trainer initialised with an NNX model "
                       "(init(model)); with a parameter tree use worker_view(state.params, "
                       "trainer.layout.params).")
    params = self.worker_view(state.params, self.layout.params, worker)
    model_state = self.worker_view(state.model_state, self.layout.model_state, worker)
    return _nnx.merge(self.config.nnx, params, model_state)

  def state_specs(self, state_like) -> TrainState:
    """PartitionSpecs of a train state (leading worker axis on per-worker leaves)."""
    specs = _step.state_specs(self.config, self.layout)
    return specs if state_like.model_state is not None else specs._replace(model_state=None)

  def state_shardings(self, state_like) -> TrainState:
    return jax.tree.map(lambda s: NamedSharding(self.config.mesh, s),
                        self.state_specs(state_like),
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))

  def batch_spec(self, batch) -> Any:
    """PartitionSpecs of a global batch (with trials, the leading trial axis unsharded)."""
    return self.config.batch_specs_for(batch)

  def step_fn(self, state, batch) -> Callable:
    """The jitted step `(state, batch) -> (state, per-device measurements, bytes sent)`.

    See `make_step`. With `donate` (the default) it consumes `state`: lowering and
    compiling it (e.g. `comm.inspect`) leaves the state usable, calling it does not.
    """
    if self._step_fn is None:
      self._step_fn = _step.make_step(self.config, self.layout, state, batch)
    return self._step_fn

  def measurements(self, per_device, sent=None) -> dict:
    """`step`'s measurements from the per-device ones that `step_fn` returns.

    Values are per worker (the data axes) under `per_worker`, means over workers at the top
    level; with `trials`, every value has a leading trial axis. Over non-data axes values
    are equal and taken once, except the squared gradient norms of leaves sharded over such
    axes (tensor parallelism), which are summed there.
    """
    return _step.measurements(self.config, self.layout, per_device, sent)

  def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
    """One training step on a global batch; returns the new state and measurements.

    Measurements: `loss` and `grad_norm` (means over workers; per-worker values under
    `per_worker`), `wire_bytes` sent by each device in this step, and `skipped_steps` (the
    steps skipped so far) when the transform contains `sync.skip_nonfinite`.
    """
    state, per_device, sent = self.dispatch(state, batch)
    return state, self.measure(per_device, sent)

  def dispatch(self, state: TrainState, batch) -> tuple[TrainState, Any, jax.Array]:
    """One step without reading anything back: `(state, per-device measurements, bytes)`.

    Everything stays on the devices (`fit` reads the values only at log steps, so the host
    never waits for a step it does not log); `measure` turns them into `step`'s dict.
    """
    _validate.step_batch(self.config, batch)
    state, per_device, sent = self.step_fn(state, batch)(state, batch)
    if self._sync_each_step:
      jax.block_until_ready(state)
    return state, per_device, sent

  def measure(self, per_device, sent) -> dict:
    """`step`'s measurements from `dispatch`'s outputs (one compiled program, on device)."""
    # One program instead of a dozen eager ops (each eager op on sharded arrays is a
    # dispatch to every device: ~1 ms a step on CPU).
    return self._measure(per_device, sent)

  def shard_batch(self, local_batch) -> Any:
    """Turns this process's share of the global batch (numpy) into sharded global arrays."""
    sharding = jax.tree.map(lambda s: NamedSharding(self.config.mesh, s),
                            self.batch_spec(local_batch),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return jax.tree.map(jax.make_array_from_process_local_data, sharding, local_batch)

  def worker_view(self, tree_stacked, per_worker_tree, worker: int = 0):
    """One worker's view of a state tree: per-worker leaves indexed, replicated ones as is.

    `worker` counts the workers of the data axes (`num_workers`); a leaf stored once per
    replica gives that worker's replica's copy. Leading axes over non-data axes stay, and
    so does the trial axis (`trials`).
    """
    mesh, axes = self.config.mesh, self.config.axes
    sizes = [mesh.shape[a] for a in axes]
    coords = dict(zip(axes, np.unravel_index(worker, sizes))) if sizes else {}  # host ints
    t = 0 if self.config.trials is None else 1  # the trial axis stays in front

    def one(pw, x):
      lead = self.config.lead_axes(pw)
      if not lead:
        return x
      x = x.reshape(*x.shape[:t], *(mesh.shape[a] for a in lead), *x.shape[t + 1:])
      keep = [a for a in lead if a not in coords]
      x = x[(slice(None),) * t +
            tuple(int(coords[a]) if a in coords else slice(None) for a in lead)]
      return x.reshape(*x.shape[:t], -1, *x.shape[t + len(keep):]) if keep else x

    return jax.tree.map(one, per_worker_tree, tree_stacked)
