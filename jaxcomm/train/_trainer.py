"""`Trainer`: a convenience over `Program`. It holds a `StepConfig` and builds the `Program`
when `init` sees the parameters (again for parameters of other shapes or another NNX model);
everything it computes is the program's."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxcomm.train import _nnx
from jaxcomm.train import _program
from jaxcomm.train import _step
from jaxcomm.train._layout import StateLayout
from jaxcomm.train._layout import StepConfig
from jaxcomm.train._program import Program
from jaxcomm.train._step import TrainState

# Read through to the StepConfig (`trainer.mesh`, `trainer.batch_axes`, ...).
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
    batch_axes: the mesh axis (or tuple of axes) the batch is split over: the workers.
    param_specs: optional PartitionSpecs of the parameters (tensor-parallel shards and
      pipeline stages over non-batch axes, ZeRO-3 shards over a batch axis); replicated by
      default. Optimiser-state leaves that mirror a parameter (same tree path suffix and
      shard shape: Adam's mu and nu, ...) get its spec.
    has_aux: whether `loss_fn` returns `(loss, aux)`; aux leaves are reported per worker.
    batch_specs: optional PartitionSpecs of the batch leaves (e.g. `P("data", "sequence")`
      for tokens split over a sequence axis); by default the leading dimension is split
      over the batch axes.
    key: opt in to randomness in the loss: a PRNG key (`jax.random.key(seed)`); the loss is
      then called `loss_fn(params, batch, key)` with `step_key(key, step, worker)`, a key
      per step and worker (a pure function of them, so a resumed run draws the same).
    mutable: how an NNX model's mutable variables (BatchNorm statistics) are kept:
      "per_worker" (default: each worker's from its own batches, stored with a leading
      worker axis; nothing is sent) or "mean" (averaged over the batch axes after every
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
  `trainer.mesh`); once `init` has seen the parameters, `trainer.program` is the `Program`
  it runs (what `fit`, checkpoints, elastic runs, the planner and `jaxcomm.testing` take)
  and `trainer.layout` its layout.

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
               mesh: jax.sharding.Mesh, *, batch_axes: str | tuple = "data",
               param_specs: Any = None, has_aux: bool = False, batch_specs: Any = None,
               key: jax.Array | None = None, mutable: str = "per_worker",
               donate: bool = True, trials: int | None = None):
    self._config = StepConfig(loss_fn, optimizer, mesh, batch_axes=batch_axes,
                              param_specs=param_specs, has_aux=has_aux,
                              batch_specs=batch_specs, key=key, mutable=mutable,
                              donate=donate, trials=trials)
    self._program = None
    self._shapes = None  # of the parameters the program was built for

  def __getattr__(self, name: str) -> Any:
    if name in _CONFIG_FIELDS:
      return getattr(self.config, name)
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  @property
  def config(self) -> StepConfig:
    """The program's configuration once built (with an NNX model's parts), else the given."""
    return self._config if self._program is None else self._program.config

  @property
  def program(self) -> Program:
    """The `Program` that `init` built (what `fit`, `Checkpointer`, ... take)."""
    if self._program is None:
      raise ValueError("call init(params) (or build(params)) before asking for the program.")
    return self._program

  @property
  def layout(self) -> StateLayout:
    return self.program.layout

  def build(self, params) -> Program:
    """The `Program` for these parameters (or NNX model), kept while their shapes stay.

    Nothing runs: `params` may be `jax.ShapeDtypeStruct`s. A new NNX model always builds
    anew (the step merges its graph).
    """
    shapes = None if _nnx.is_module(params) else jax.tree.map(
        lambda x: (jnp.shape(x), jnp.result_type(x)), params)
    if self._program is None or shapes is None or shapes != self._shapes:
      self._program, self._shapes = Program.build(self._config, params), shapes
    return self._program

  def init(self, params) -> TrainState:
    """The initial train state from the (replicated) initial parameters or an NNX model.

    Args:
      params: a parameter tree, or an `nnx.Module` (split into its parameters, which the
        optimiser sees, and its other variables, `TrainState.model_state`). With `trials`,
        every leaf carries a leading trial axis (e.g. `jax.vmap(model.init)(keys)`).
    """
    return self.build(params).init(params)

  def model(self, state: TrainState, worker: int = 0) -> Any:
    """The trained NNX model of worker `worker` (see `Program.model`)."""
    return self.program.model(state, worker)

  def state_specs(self, state_like=None) -> TrainState:
    """PartitionSpecs of the train state (leading worker axis on per-worker leaves)."""
    del state_like  # the program's layout says it all
    return self.program.state_specs()

  def state_shardings(self, state_like=None) -> TrainState:
    del state_like
    return self.program.state_shardings()

  def batch_spec(self, batch) -> Any:
    """PartitionSpecs of a global batch (with trials, the leading trial axis unsharded)."""
    return self.config.batch_specs_for(batch)

  def step_fn(self, state=None, batch=None) -> Callable:
    """The jitted step `(state, batch) -> (state, per-device measurements, bytes sent)`.

    `Program.step` (see `make_step`); the arguments are not needed. With `donate` (the
    default) it consumes `state`: lowering and compiling it (e.g. `comm.inspect`) leaves
    the state usable, calling it does not.
    """
    del state, batch
    return self.program.step

  def measurements(self, per_device, sent=None) -> dict:
    """`step`'s measurements from the per-device ones that `step_fn` returns (see
    `Program.measure`, the jitted form)."""
    return _step.measurements(self.config, self.layout, per_device, sent)

  def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
    """One training step on a global batch; returns the new state and measurements.

    Measurements: `loss` and `grad_norm` (means over workers; per-worker values under
    `per_worker`), `wire_bytes` sent by each device in this step, and `skipped_steps` (the
    steps skipped so far) when the transform contains `sync.skip_nonfinite`.
    """
    state, per_device, sent = self.program.dispatch(state, batch)
    return state, self.program.measure(per_device, sent)

  def dispatch(self, state: TrainState, batch) -> tuple[TrainState, Any, jax.Array]:
    """One step without reading anything back (see `Program.dispatch`)."""
    return self.program.dispatch(state, batch)

  def measure(self, per_device, sent) -> dict:
    """`step`'s measurements from `dispatch`'s outputs (one compiled program, on device)."""
    return self.program.measure(per_device, sent)

  def shard_batch(self, local_batch) -> Any:
    """Turns this process's share of the global batch (numpy) into sharded global arrays
    (before `init` too: it needs only the mesh and the batch axes)."""
    return _program.shard_batch(self.config, local_batch)

  def worker_view(self, tree_stacked, per_worker_tree, worker: int = 0):
    """One worker's view of a state tree (see `Program.worker_view`)."""
    return self.program.worker_view(tree_stacked, per_worker_tree, worker)
