"""The models `experiments.build` can train: one module per model, loaded by name.

A model is one module, loaded by name like a method (no registry, nothing runs at import): a
name in experiments/models/ (`lm`), a dotted module path or the path of a `.py` file. Such a
module defines

  defaults() -> ml_collections.ConfigDict   its settings (the fields of config.model it reads)
  build(settings, ctx) -> Task              ctx: a `ModelContext` (data, mesh, key, layout)

and may define `check(settings)` (raises a ValueError naming a setting out of range; run
before anything is built) and `layout(settings, mesh, config) -> parallel.Layout | None` (a
model laid out over fsdp / tensor / replica axes; the method then syncs the replicas). A
model of your own is one file: `--config.model.name=/path/to/my_model.py`; its settings are
its defaults, and a field of the same name that config.model sets overrides one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import ModuleType
from typing import Any, Callable

import jax
import ml_collections

from experiments import _plugins

# Mesh axes that split the model, not the batch; every other axis splits the batch.
MODEL_AXES = ("tensor", "sequence", "pipeline")


@dataclasses.dataclass(frozen=True)
class Task:
  """What a model module's `build` returns: the model, its loss and its data.

  Attributes:
    model: the model (Flax linen or NNX).
    loss_fn: `(params, batch) -> loss`, or `(loss, aux)` when `has_aux`.
    has_aux: whether `loss_fn` returns `(loss, aux)`.
    params: the initial parameters (an NNX module: the Trainer splits it), or their
      `jax.ShapeDtypeStruct`s when built abstract.
    batches: `step -> this process's share of global batch number step`.
    specs: PartitionSpecs of the parameters (None: replicated).
    batch_specs: PartitionSpecs of the batch (None: leading dimension over the batch axes).
    mutable: how an NNX model's mutable variables are kept: "per_worker" or "mean".
  """
  model: Any
  loss_fn: Callable
  has_aux: bool
  params: Any
  batches: Callable[[int], dict]
  specs: Any = None
  batch_specs: Any = None
  mutable: str = "per_worker"


@dataclasses.dataclass(frozen=True)
class ModelContext:
  """What a model module's `build` receives besides its own settings.

  Attributes:
    config: the whole run's settings (read-only; config.data, config.seed, config.mesh).
    mesh_shape: {axis: size} of the run's mesh.
    layout: the `parallel.Layout` the model's `layout()` returned, or None.
    key: the run's PRNG key, `jax.random.key(config.seed)`.
    abstract: build `jax.ShapeDtypeStruct`s instead of initialising (see `init`).
    batches: `step -> batch` of config.data (the run's batches).
    dataset: `() -> the loaded dataset` of config.data.name (None for a folder of files).
  """
  config: ml_collections.ConfigDict
  mesh_shape: dict
  layout: Any
  key: jax.Array
  abstract: bool
  batches: Callable[[int], dict]
  dataset: Callable[[], Any]

  def init(self, fn: Callable) -> Callable:
    """`fn` (a model's init) jitted, or its shapes only when the run is built abstract."""
    return functools.partial(jax.eval_shape, fn) if self.abstract else jax.jit(fn)

  @property
  def workers(self) -> int:
    """The data-parallel workers: the product of every axis that splits the batch."""
    return math.prod(n for a, n in self.mesh_shape.items() if a not in MODEL_AXES)

  def data_parallel_only(self, also: tuple = ()) -> None:
    """Refuses a mesh with model axes (or `also`): a model without layouts of its own."""
    if set(self.mesh_shape) & {*MODEL_AXES, *also}:
      raise ValueError(f"config.mesh {self.config.mesh!r} lays out the linen LM only; use "
                       f"config.model.name 'lm' or a mesh of data axes.")


def available_models() -> list[str]:
  """The models that ship in experiments/models/."""
  return _plugins.available(__path__)


@functools.lru_cache(maxsize=None)
def load_model(name: str) -> ModuleType:
  """The module of model `name`: experiments/models/<name>.py, a dotted module path, or a
  `.py` file path. Raises a ValueError naming the model when there is none."""
  return _plugins.load(name, __name__, "model", available_models())


def model_defaults(name: str) -> ml_collections.ConfigDict:
  """The settings of model `name` with their defaults."""
  return load_model(name).defaults()


def shared_fields() -> ml_collections.ConfigDict:
  """config.model's fields: every shipped model's settings, each with its default (models
  that share a setting share its default), so that `--config.model.name=` may switch
  between them and set any of their settings on the command line."""
  out = ml_collections.ConfigDict()
  for name in available_models():
    for key, value in model_defaults(name).items():
      if key in out and out[key] != value:
        raise ValueError(f"models disagree on the default of model.{key}: {out[key]!r} and "
                         f"{value!r} ({name}); give the setting one default or two names.")
      setattr(out, key, value)
  return out


def settings(model: ml_collections.ConfigDict,
             name: str | None = None) -> ml_collections.ConfigDict:
  """The settings of config.model's model (or of model `name`): its defaults, overridden by
  the fields of the same name that config.model (`model`) sets. A field of the shared tree
  (`shared_fields`) left at its default is not a choice: a model of your own keeps its own
  default then."""
  name = name or model.name
  out, shared = model_defaults(name), shared_fields()
  with out.unlocked():
    for key in out.keys():
      if key in model and (key not in shared or model[key] != shared[key]):
        try:
          out[key] = model[key]
        except TypeError:
          raise ValueError(f"config.model.{key} must be like {out[key]!r} for model "
                           f"{name!r}, got {model[key]!r}.") from None
    out.name = name
  return out


def check(model: ml_collections.ConfigDict) -> None:
  """Checks config.model before anything is built: the model exists, and every model that
  defines `check(settings)` (the shipped ones, and the one named) finds its settings in
  range, so that a bad value fails even where the model named does not read it.

  Raises:
    ValueError: naming the setting (config.model.<field>) and its allowed values.
  """
  for name in dict.fromkeys([model.name, *available_models()]):
    fn = getattr(load_model(name), "check", None)
    if fn is not None:
      fn(settings(model, name))
