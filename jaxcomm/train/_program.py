"""`Program`: what training needs, fixed once: the pure step and the functions of its layout.

A `Program` is a frozen record of a `StepConfig`, the `StateLayout` derived once from the
example parameters, the jitted `init` and `step` (`make_init`, `make_step`) and the functions
of (config, layout) that a loop needs around the step: placing a batch, placing and viewing
the train state, reading the measurements, giving an NNX model back. Nothing in it changes
after it is built; the training loop (`fit`), checkpoints, elastic runs, the planner and
`jaxcomm.testing` take it. `Trainer` is a convenience over it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.train import _nnx
from jaxcomm.train import _step
from jaxcomm.train import _validate
from jaxcomm.train._layout import StateLayout
from jaxcomm.train._layout import StepConfig
from jaxcomm.train._layout import derive_layout
from jaxcomm.train._step import TrainState


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def shard_batch(config: StepConfig, local_batch: Any) -> Any:
  """This process's share of a global batch (numpy) as sharded global arrays: a function of
  the configuration alone, so a batch can be placed before any parameters are seen."""
  sharding = jax.tree.map(lambda s: NamedSharding(config.mesh, s),
                          config.batch_specs_for(local_batch), is_leaf=_is_spec)
  return jax.tree.map(jax.make_array_from_process_local_data, sharding, local_batch)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """A training program, fixed once: configuration, layout, init, step and their helpers.

  Built by `make_program` (or `Program.build` from a `StepConfig`); `Trainer.program` hands
  over a Trainer's.

  Attributes:
    config: the `StepConfig` (for an NNX model, with its `nnx` parts).
    layout: the train state's `StateLayout`, derived once from the example parameters.
    init: `(params, model_state=None) -> TrainState`, jitted (`make_init`); `params` may be
      an `nnx.Module`, split as `Program.build` split the example.
    step: `(state, batch) -> (state, per-device measurements, bytes sent)`, jitted
      (`make_step`); it consumes `state` when `config.donate`.
    measure: `(per-device measurements, bytes=None) -> dict`, jitted (`measurements`):
      means over workers, `per_worker` values and `wire_bytes`.
  """
  config: StepConfig
  layout: StateLayout
  init: Callable
  step: Callable
  measure: Callable

  @classmethod
  def build(cls, config: StepConfig, params: Any) -> Program:
    """The program of `config` for parameters shaped like `params` (nothing is run).

    Args:
      config: the step's configuration.
      params: example parameters (arrays or `jax.ShapeDtypeStruct`s; with `config.trials`,
        with their leading trial axis), or an `nnx.Module` (its `nnx.Param`s become the
        parameters, its other variables `TrainState.model_state`).
    """
    model_state = None
    if _nnx.is_module(params):
      parts, params, model_state = _nnx.split(params)
      _validate.mutable_state(config.mutable, model_state, parts.is_variable())
      config = dataclasses.replace(config, nnx=parts)
    _validate.trial_axis("params", params, config.trials)
    _validate.trial_axis("model_state", model_state, config.trials)
    layout = derive_layout(config, params, model_state)
    return cls(config=config, layout=layout, init=_initializer(config, layout),
               step=_step.make_step(config, layout),
               measure=jax.jit(functools.partial(_step.measurements, config, layout)))

  # ---------------------------------------------------------------- the state
  def state_specs(self) -> TrainState:
    """PartitionSpecs of the train state (leading worker axis on per-worker leaves)."""
    return _step.state_specs(self.config, self.layout)

  def state_shardings(self) -> TrainState:
    """The `NamedSharding` of every leaf of the train state, on `config.mesh`."""
    return jax.tree.map(lambda s: NamedSharding(self.config.mesh, s), self.state_specs(),
                        is_leaf=_is_spec)

  def worker_view(self, tree_stacked: Any, per_worker_tree: Any, worker: int = 0) -> Any:
    """One worker's view of a state tree: per-worker leaves indexed, replicated ones as is.

    `per_worker_tree` is the tree's part of the layout (`layout.params`, ...). `worker`
    counts the workers of the batch axes (`config.num_workers`); a leaf stored once per
    replica gives that worker's replica's copy. Leading axes over non-batch axes stay, and
    so does the trial axis (`trials`).
    """
    config = self.config
    mesh, axes = config.mesh, config.batch_axes
    sizes = [mesh.shape[a] for a in axes]
    coords = dict(zip(axes, np.unravel_index(worker, sizes))) if sizes else {}  # host ints
    t = 0 if config.trials is None else 1  # the trial axis stays in front

    def one(pw, x):
      lead = config.lead_axes(pw)
      if not lead:
        return x
      x = x.reshape(*x.shape[:t], *(mesh.shape[a] for a in lead), *x.shape[t + 1:])
      keep = [a for a in lead if a not in coords]
      x = x[(slice(None),) * t +
            tuple(int(coords[a]) if a in coords else slice(None) for a in lead)]
      return x.reshape(*x.shape[:t], -1, *x.shape[t + len(keep):]) if keep else x

    return jax.tree.map(one, per_worker_tree, tree_stacked)

  def model(self, state: TrainState, worker: int = 0) -> Any:
    """The trained NNX model: worker `worker`'s parameters and variables merged again.

    Call `.eval()` on it before evaluating (BatchNorm's running averages, no dropout).
    With `trials`, the model's arrays carry the leading trial axis.
    """
    if self.config.nnx is None:
      raise ValueError("model() needs a program built from an NNX model; with a parameter "
                       "tree use worker_view(state.params, layout.params).")
    params = self.worker_view(state.params, self.layout.params, worker)
    model_state = self.worker_view(state.model_state, self.layout.model_state, worker)
    return _nnx.merge(self.config.nnx, params, model_state)

  # ---------------------------------------------------------------- the batch
  def batch_specs(self, batch: Any) -> Any:
    """PartitionSpecs of a global batch (with trials, the leading trial axis unsharded)."""
    return self.config.batch_specs_for(batch)

  def shard_batch(self, local_batch: Any) -> Any:
    """Turns this process's share of the global batch (numpy) into sharded global arrays."""
    return shard_batch(self.config, local_batch)

  # ---------------------------------------------------------------- stepping
  def dispatch(self, state: TrainState, batch: Any) -> tuple[TrainState, Any, jax.Array]:
    """One checked step without reading anything back: `step`'s outputs, on the devices.

    The batch is checked against the step's shapes first. On emulated CPU devices the
    step is waited for: XLA:CPU can deadlock in an all-reduce rendezvous when executions of
    a collective program overlap across devices (a device runs step t + 1 into a collective
    while others still wait for a thread for step t; seen with jaxlib 0.10.2 whenever the
    collective comes first in the program, e.g. `local.delayed`), so one step at a time.
    """
    _validate.step_batch(self.config, batch)
    state, per_device, sent = self.step(state, batch)
    if self._on_cpu:
      jax.block_until_ready(state)
    return state, per_device, sent

  @functools.cached_property
  def _on_cpu(self) -> bool:  # asked once: a mesh may hold thousands of devices
    return all(d.platform == "cpu" for d in self.config.mesh.devices.flat)


def _initializer(config: StepConfig, layout: StateLayout) -> Callable:
  """`make_init`'s program, taking an NNX model as well as its parameters."""
  start = _step.make_init(config, layout)

  def init(params: Any, model_state: Any = None) -> TrainState:
    if _nnx.is_module(params):
      _, params, model_state = _nnx.split(params)
    _validate.trial_axis("params", params, config.trials)
    _validate.trial_axis("model_state", model_state, config.trials)
    return start(params, model_state)

  return init


def make_program(loss_fn: Callable, optimizer: optax.GradientTransformation,
                 mesh: jax.sharding.Mesh, params: Any, **options: Any) -> Program:
  """The training program of a loss, a transform and a mesh, for parameters like `params`.

  The layout is derived once, here, from the parameters' shapes; `init` and `step` are
  built from it (traced at their first call). `fit`, `Checkpointer.restore`,
  `jaxcomm.elastic`, `jaxcomm.plan` and `jaxcomm.testing` take the result.

  Args:
    loss_fn: the per-worker loss (see `Trainer`).
    optimizer: the transform (see `Trainer`).
    mesh: the device mesh.
    params: example parameters (arrays or `jax.ShapeDtypeStruct`s) or an `nnx.Module`.
    **options: `StepConfig`'s other fields, as `Trainer` takes them: `batch_axes`,
      `param_specs`, `has_aux`, `batch_specs`, `key`, `mutable`, `donate`, `trials`.

  Returns:
    A `Program`.

  >>> import jax.numpy as jnp, optax
  >>> from jaxcomm import sync
  >>> from jaxcomm.parallel import make_mesh
  >>> loss = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
  >>> program = make_program(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)),
  ...                        make_mesh({"data": 8}), {"w": jnp.zeros(())})
  >>> state = program.init({"w": jnp.zeros(())})
  >>> batch = program.shard_batch({"x": jnp.ones(16), "y": 2 * jnp.ones(16)})
  >>> state, per_device, sent = program.step(state, batch)
  >>> float(state.params["w"]), float(program.measure(per_device)["loss"]), int(sent)
  (0.4000000059604645, 4.0, 7)
  """
  return Program.build(StepConfig(loss_fn, optimizer, mesh, **options), params)
