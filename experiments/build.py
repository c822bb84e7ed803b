"""One way from settings to a run: `build(config) -> Run`.

Every program (train.py, compare.py, the reproductions, the benchmarks, the notebooks) turns
a config (experiments/config.py) into a `Run` here, and nowhere else:

  run = build(config)                 # model, loss, params, batches, optimizer, mesh, specs
  program = run.program()             # jaxcomm.train.Program
  state, history = train.fit(program, program.init(run.params), run.batches, run.steps)

A method is one module, loaded by name (no registry, nothing runs at import): a name in
experiments/methods/ (`diloco`), a dotted module path (`my_pkg.my_method`) or the path of a
`.py` file. Such a module defines

  defaults() -> ml_collections.ConfigDict   its settings (factory defaults read with
                                            experiments.toolkit.from_factory)
  build(settings, ctx) -> optax transform   ctx: a `Context` (inner optimiser, axes, ...)

and may define the optional hooks of `experiments.methods.Hooks` (`wrap_loss`, `period`,
`overlap_steps`, ...; each with its default there), read through `hooks(name)`. A method of
your own is one file: `--config=experiments/configs/default.py:/path/to/my_method.py`.

A model is one module too, in experiments/models/ (`lm`, `mlp`, `nnx_lm`, `resnet50`, ...)
or anywhere (`--config.model.name=/path/to/my_model.py`): `defaults()` and
`build(settings, ctx) -> experiments.models.Task` (see experiments/models/__init__.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from types import ModuleType
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

from . import config as _config
from . import specs
from . import methods as _methods
from . import models as _models
from jaxcomm import comm, data, parallel, sync, train

# Mesh axes that split the model, not the batch; every other axis splits the batch.
MODEL_AXES = _models.MODEL_AXES
# The axis names a config's mesh may use: a misspelt name would be one more batch axis
# that nothing reduces (the Trainer refuses that too, after tracing the step).
MESH_AXES = ("replica", "data", "fsdp", "tensor", "sequence", "pipeline")


# ---------------------------------------------------------------- methods
available_methods = _methods.available_methods
load_method = _methods.load_method
method_defaults = _methods.method_defaults
hooks = _methods.hooks
available_models = _models.available_models
load_model = _models.load_model
model_defaults = _models.model_defaults


@dataclasses.dataclass(frozen=True)
class Context:
  """What a method module's `build` receives besides its own settings.

  Attributes:
    config: the whole run's settings (read-only).
    inner: the inner optimiser (config.optimizer; wrapped in ZeRO-3 on an fsdp mesh).
    axis_name: the mesh axis (or axes) the method synchronises over.
    num_workers: workers along `axis_name`.
    mesh_shape: {axis: size} of the run's mesh.
    key: the run's PRNG key, `jax.random.key(config.seed)`.
    param_specs: the parameters' PartitionSpecs on a laid-out mesh (None: replicated); a
      method that needs a whole-tensor view of sharded parameters (PowerSGD) takes them.
  """
  config: ml_collections.ConfigDict
  inner: optax.GradientTransformation
  axis_name: Any
  num_workers: int
  mesh_shape: dict
  key: jax.Array
  param_specs: Any = None

  def participation(self, spec: str | None, syncs_per_period: int = 1,
                    num_workers: int | None = None):
    """The participation mask of a spec (config.participation_mask), covering every sync of
    the run: `syncs_per_period` syncs every `config.method.sync_every` steps."""
    sync_every = self.config.method.get("sync_every") or 1
    num_syncs = syncs_per_period * (self.config.steps // max(int(sync_every), 1) + 1)
    return specs.participation_mask(spec, num_workers or self.num_workers, num_syncs,
                                      self.config.seed)

  def codec(self, spec: str | None, setting: str = "codec"):
    """The codec of a spec string (config.parse_codec), naming the method's setting."""
    return specs.parse_codec(spec, setting)


# ---------------------------------------------------------------- the run
@dataclasses.dataclass(frozen=True)
class Run:
  """Everything a program needs to train one configured method.

  Attributes:
    config: the settings it was built from.
    mesh: the device mesh.
    model: the Flax model.
    loss_fn: `(params, batch) -> loss` (or `(loss, aux)` when `has_aux`): what each worker
      differentiates (the method's `wrap_loss` applied).
    model_loss_fn: the model's own loss, before the method's `wrap_loss`.
    has_aux: whether `loss_fn` returns `(loss, aux)`.
    params: the initial parameters (`jax.ShapeDtypeStruct`s when built `abstract`).
    batches: `step -> this process's share of global batch number step` (numpy): a pure
      function of (seed, step), so a resumed run needs only the step. Built `abstract`:
      the shapes of that share (`jax.ShapeDtypeStruct`s; nothing of the batch's size is
      loaded).
    optimizer: the method's transform around the inner optimiser.
    batch_axes: the mesh axes the batch is split over (the program's `batch_axes`).
    method_axes: the axes the method synchronises over (what its transforms get as
      `axis_name`: `Context.axis_name`).
    specs: PartitionSpecs of the parameters (None: replicated).
    batch_specs: PartitionSpecs of the batch (None: leading dimension over the batch axes).
    method: the method's module.
    mutable: how an NNX model's mutable variables are kept ("per_worker" or "mean").
  """
  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  model: Any
  loss_fn: Callable
  model_loss_fn: Callable
  has_aux: bool
  params: Any
  batches: Callable[[int], dict]
  optimizer: optax.GradientTransformation
  batch_axes: tuple
  method_axes: Any
  specs: Any = None
  batch_specs: Any = None
  method: ModuleType | None = None
  mutable: str = "per_worker"

  @property
  def steps(self) -> int:
    return int(self.config.steps)

  @property
  def num_workers(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.batch_axes)

  def _options(self) -> dict:
    return dict(batch_axes=self.batch_axes, param_specs=self.specs, has_aux=self.has_aux,
                batch_specs=self.batch_specs, mutable=self.mutable)

  def program(self) -> train.Program:
    """The training program (`jaxcomm.train.Program`) that `fit`, checkpoints and the
    planner take; its layout derived from `params` (arrays or ShapeDtypeStructs)."""
    return train.make_program(self.loss_fn, self.optimizer, self.mesh, self.params,
                              **self._options())

  def trainer(self) -> train.Trainer:
    """A `jaxcomm.train.Trainer` of the run (steps that return their measurements)."""
    return train.Trainer(self.loss_fn, self.optimizer, self.mesh, **self._options())


def mesh_shape(spec: str, num_devices: int) -> dict:
  """{axis: size} of config.mesh; "" is one `data` axis over every device."""
  if not spec:
    return {"data": num_devices}
  try:
    shape = parallel.parse_mesh(spec)
  except ValueError as e:
    raise ValueError(f"config.mesh: {e}") from None
  if math.prod(shape.values()) != num_devices:
    raise ValueError(f"config.mesh {spec!r} multiplies to {math.prod(shape.values())}, but "
                     f"there are {num_devices} devices.")
  if "sequence" in shape and "pipeline" in shape:
    raise ValueError(f"config.mesh {spec!r}: sequence and pipeline axes together are not "
                     "supported.")
  if all(a in MODEL_AXES for a in shape):  # the batch needs an axis, if only of size 1
    shape = {"data": 1, **shape}
  return shape


def check_mesh_axes(config: ml_collections.ConfigDict) -> None:
  """config.mesh names MESH_AXES and the axes the method's settings name (`hierarchical`'s
  `slow_axis` / `fast_axis`) only: any other name is a typo, refused with the nearest name.
  (`parallel.make_mesh` keeps free names for a library user who reduces them.)"""
  named = {f"method.{k}": a for k, a in config.method.items()
           if k.endswith("_axis") and isinstance(a, str)}
  known = (*MESH_AXES, *named.values())
  for axis in (parallel.parse_mesh(config.mesh) if config.mesh else {}):
    if axis not in known:
      near = difflib.get_close_matches(axis, known, n=1)
      raise ValueError(f"config.mesh {config.mesh!r}: unknown axis {axis!r}"
                       f"{f' (did you mean {near[0]!r}?)' if near else ''}; allowed: "
                       f"{', '.join(MESH_AXES)}"
                       f"{''.join(f', {a!r} (config.{k})' for k, a in named.items())}.")


def build(config: ml_collections.ConfigDict, devices=None, *, abstract: bool = False) -> Run:
  """The run `config` describes, checked before anything compiles.

  Args:
    config: the settings (experiments/config.py's tree).
    devices: the devices of the mesh (default: all).
    abstract: give the parameters and batches as `jax.ShapeDtypeStruct`s (nothing is
      initialised, loaded or compiled: for checking settings and for planning real model
      sizes, `jaxcomm.plan`).

  Raises:
    ValueError: one line naming the setting that is wrong.
  """
  _config.check(config)
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(config.mesh, len(devices))
  check_mesh_axes(config)
  method = load_method(config.method.name)
  # The sequence axis splits the batch too: each shard's gradient is a partial sum.
  batch_axes = tuple(a for a in shape if a not in MODEL_AXES or a == "sequence")
  _check_batch(config, shape)
  mesh = train.make_mesh(shape, devices=devices)
  model_settings = _models.settings(config.model)
  model_layout = getattr(load_model(config.model.name), "layout", None)
  layout = model_layout(model_settings, mesh, config) if model_layout else None
  if layout is not None:  # the method syncs replicas of the laid-out model
    method_axes = comm.axis_names(layout.replica_axis)
  else:
    method_axes = batch_axes
  ctx = Context(config=config, inner=_inner_optimizer(config.optimizer),
                axis_name=(method_axes[0] if len(method_axes) == 1 else method_axes) or None,
                num_workers=math.prod(shape[a] for a in method_axes), mesh_shape=shape,
                key=jax.random.key(config.seed))
  optimizer = make_optimizer(config, ctx)  # the method's settings fail before any compile
  task = _task(config, shape, layout, abstract)
  if layout is not None:
    # Inside a replica the gradient is reduced exactly (ZeRO-3 over fsdp, the mean over
    # data); the method then runs once per group of equally sharded leaves.
    ctx = dataclasses.replace(ctx, param_specs=task.specs)
    optimizer = layout.optimizer(make_optimizer(config, ctx), task.specs,
                                 task.model.param_regather())
  loss_fn = task_loss(config, task.loss_fn, ctx)
  batches = _batch_shapes(task.batches, config) if abstract else task.batches
  if config.skip_nonfinite:
    optimizer = sync.skip_nonfinite(optimizer, batch_axes[0] if len(batch_axes) == 1
                                    else batch_axes)
  return Run(config=config, mesh=mesh, model=task.model, loss_fn=loss_fn,
             model_loss_fn=task.loss_fn, has_aux=task.has_aux, params=task.params,
             batches=batches, optimizer=optimizer, batch_axes=batch_axes,
             method_axes=ctx.axis_name, specs=task.specs, batch_specs=task.batch_specs,
             method=method, mutable=task.mutable)


def local_context(config: ml_collections.ConfigDict) -> Context:
  """The context of the method on one device: no axis, no communication (a worker's own
  compute, for timing it; every jaxcomm transform runs with axis_name=None)."""
  _config.check(config)
  return Context(config=config, inner=_inner_optimizer(config.optimizer), axis_name=None,
                 num_workers=1, mesh_shape={}, key=jax.random.key(config.seed))


def make_optimizer(config: ml_collections.ConfigDict, ctx: Context):
  """The method's transform (config.method) in context `ctx`."""
  try:
    return load_method(config.method.name).build(config.method, ctx)
  except ValueError as e:
    raise ValueError(f"config.method ({config.method.name}): {e}") from None


def task_loss(config: ml_collections.ConfigDict, loss_fn: Callable, ctx: Context) -> Callable:
  """The loss each worker differentiates: the method's `wrap_loss` applied (by default the
  loss itself)."""
  try:
    return hooks(config.method.name).wrap_loss(config.method, loss_fn, ctx)
  except ValueError as e:
    raise ValueError(f"config.method ({config.method.name}): {e}") from None


def _check_batch(config, shape: dict) -> None:
  """The global batch's leading dimension splits over every axis but the model's."""
  axes = tuple(a for a in shape if a not in MODEL_AXES)
  workers = math.prod(shape[a] for a in axes)
  if config.data.batch_size % workers:
    raise ValueError(f"config.data.batch_size ({config.data.batch_size}) must be divisible "
                     f"by the {workers} workers of the mesh axes {axes}.")


def _inner_optimizer(c: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """config.optimizer's inner optimiser; with `schedule="schedule_free"` (set by
  experiments.compare's config.compare.schedule) its schedule-free form (Defazio et al.,
  arXiv 2405.15682: momentum replaced by interpolation and averaging, a linear warmup of
  `warmup_steps`, no decay; evaluate at `optax.contrib.schedule_free_eval_params`); with
  `schedule="wsd"`, its rate by `wsd_schedule` (`warmup_steps`, `decay_start`,
  `decay_steps`)."""
  schedule = c.get("schedule", "constant")
  if schedule not in _config.SCHEDULES:
    raise ValueError("config.optimizer.schedule must be one of "
                     f"{', '.join(_config.SCHEDULES)}, got {schedule!r}.")
  if schedule == "schedule_free":
    warmup = int(c.get("warmup_steps", 0)) or None
    if c.name in ("adamw", "adam"):
      return optax.contrib.schedule_free_adamw(
          c.lr, warmup_steps=warmup, weight_decay=c.weight_decay if c.name == "adamw" else 0.0)
    return optax.contrib.schedule_free_sgd(c.lr, warmup_steps=warmup)  # b1 is the momentum
  lr = c.lr if schedule == "constant" else wsd_schedule(
      c.lr, int(c.get("warmup_steps", 0)), c.get("decay_start"), c.get("decay_steps"))
  if c.name == "adamw":
    return optax.adamw(lr, weight_decay=c.weight_decay)
  if c.name == "adam":
    return optax.adam(lr)
  if c.name == "sgd":
    return optax.sgd(lr)
  return optax.sgd(lr, momentum=0.9)  # "momentum" (config.check allows no other name)


def wsd_schedule(lr: float, warmup: int, decay_start: int | None, decay_steps: int | None):
  """Warmup-stable-decay (`schedule="wsd"`): the rate of update `count` (0 first) rises
  linearly over `warmup` updates, stays at `lr`, and from update `decay_start` falls
  linearly towards 0 over `decay_steps` updates, lr (D - i) / (D + 1) at the decay's i-th
  (0 first; 0 only after it; no decay with `decay_start` None: the stable phase, whose
  optimiser state a decay branches from).

  >>> f = wsd_schedule(1.0, warmup=2, decay_start=4, decay_steps=4)
  >>> [round(float(f(c)), 6) for c in range(9)]
  [0.5, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.0]
  """
  def rate(count):
    x = jnp.minimum(1.0, (count + 1.0) / warmup) if warmup else jnp.ones(())
    if decay_start is not None:
      x = x * jnp.clip((decay_start + decay_steps - count) / (decay_steps + 1.0), 0.0, 1.0)
    return lr * x
  return rate


def inner_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The inner optimiser of config.optimizer (for programs that build methods themselves)."""
  _config.check(config)
  return _inner_optimizer(config.optimizer)


# ---------------------------------------------------------------- models and data
def model_task(config: ml_collections.ConfigDict, workers: int = 1) -> tuple:
  """(model, loss_fn, has_aux, params, batches) of config.model / config.data without a
  mesh or layout: for programs that build their own steps (benchmarks, the planner).
  `workers` only sizes a label-skewed split."""
  _config.check(config)
  task = _task(config, {"data": workers}, None)
  return task.model, task.loss_fn, task.has_aux, task.params, task.batches


def _task(c: ml_collections.ConfigDict, shape: dict, layout,
          abstract: bool = False) -> _models.Task:
  """config.model's model module built on config.data's batches (experiments/models/)."""
  workers = math.prod(n for a, n in shape.items() if a not in MODEL_AXES)
  stored = not c.data.name.startswith("folder:")
  if c.data.label_skew and not (stored and isinstance(_dataset(c), data.ArrayDataset)):
    raise ValueError("config.data.label_skew splits labelled data: it needs model 'mlp'.")
  # Abstract: batches of one row per worker, whose shapes `build` stretches to the batch.
  batches = _make_batches(_one_row_per_worker(c, workers) if abstract else c, workers)
  ctx = _models.ModelContext(config=c, mesh_shape=shape, layout=layout,
                             key=jax.random.key(c.seed), abstract=abstract, batches=batches,
                             dataset=lambda: _dataset(c))
  return load_model(c.model.name).build(_models.settings(c.model), ctx)


def _make_batches(c: ml_collections.ConfigDict, workers: int) -> Callable[[int], dict]:
  """`step -> this process's share of global batch number step` (config.data.pipeline)."""
  if c.data.pipeline == "grain":
    try:
      ds = data.batches(c.data.name, c.data.batch_size, seq_len=c.data.seq_len,
                        split=c.data.split, seed=c.seed,
                        label_skew=c.data.label_skew or None, num_workers=workers)
    except ValueError as e:
      raise ValueError(f"config.data: {e}") from None
    return ds.__getitem__
  dataset = _dataset(c)
  pi, pc = jax.process_index(), jax.process_count()
  if isinstance(dataset, data.TextDataset):
    return lambda t: dataset.batch(t, c.data.batch_size, seq_len=c.data.seq_len, seed=c.seed,
                                   process_index=pi, process_count=pc)
  if c.data.label_skew:  # each worker's slice of the batch from its own skewed shard
    dataset = data.label_skew(dataset, workers, c.data.label_skew, seed=c.seed)
  return lambda t: dataset.batch(t, c.data.batch_size, seed=c.seed, process_index=pi,
                                 process_count=pc)


def _one_row_per_worker(c: ml_collections.ConfigDict, workers: int):
  """`c` with a global batch of one row per worker (for batch shapes: `_batch_shapes`)."""
  small = c.copy_and_resolve_references()
  small.data.batch_size = workers
  return small


def _batch_shapes(batches: Callable[[int], dict], c: ml_collections.ConfigDict) -> Callable:
  """`step -> ShapeDtypeStructs` of this process's share of a global batch of
  config.data.batch_size rows, from `batches` of fewer rows (nothing of the batch's size
  is loaded)."""
  share = c.data.batch_size // jax.process_count()
  return lambda t: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((share, *x.shape[1:]), x.dtype), batches(t))


@functools.lru_cache(maxsize=8)
def _load(name: str):
  return data.load(name)


def _dataset(c):
  try:
    dataset = _load(c.data.name)
  except ValueError as e:
    raise ValueError(f"config.data.name: {e}") from None
  if c.data.split == "all":
    return dataset
  return dataset.split()[0 if c.data.split == "train" else 1]
