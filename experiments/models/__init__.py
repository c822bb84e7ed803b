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

import functools
from types import ModuleType

import ml_collections

from .. import _plugins, toolkit

# What a model module's build() returns and receives (experiments/toolkit.py).
MODEL_AXES = toolkit.MODEL_AXES
Task = toolkit.Task
ModelContext = toolkit.ModelContext


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
