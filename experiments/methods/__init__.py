"""The methods `experiments.build` can run: one module per method, loaded by name.

Each module defines `defaults()` (its settings, the library factory's defaults read from its
signature) and `build(settings, ctx)` (the optax transform); optionally `wrap_loss` and
`overlap_steps`. See experiments/build.py for the contract; a method of your own is one such
file anywhere (`config.method.name = "/path/to/my_method.py"`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import numbers
import os
import pkgutil
import sys
from types import ModuleType

import ml_collections
import optax


def available_methods() -> list[str]:
  """The methods that ship in experiments/methods/."""
  return sorted(m.name for m in pkgutil.iter_modules(__path__)
                if not m.name.startswith("_"))


@functools.lru_cache(maxsize=None)
def load_method(name: str) -> ModuleType:
  """The module of method `name`: experiments/methods/<name>.py, a dotted module path, or a
  `.py` file path. Raises a ValueError naming the method when there is none."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"config.method.name must name a method, got {name!r}; allowed: "
                     f"{', '.join(available_methods())}, a module path or a .py file.")
  if name.endswith(".py"):
    if not os.path.isfile(name):
      raise ValueError(f"config.method.name {name!r}: no such file.")
    module_name = "jaxcomm_method_" + os.path.splitext(os.path.basename(name))[0]
    spec = importlib.util.spec_from_file_location(module_name, name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
  else:
    path = name if "." in name else f"experiments.methods.{name}"
    try:
      module = importlib.import_module(path)
    except ModuleNotFoundError as e:
      if e.name not in (path, *_parents(path)):
        raise  # the method exists but one of its own imports is missing
      raise ValueError(f"config.method.name {name!r} is unknown; allowed: "
                       f"{', '.join(available_methods())}, a module path or a .py file."
                       ) from None
  for attr in ("defaults", "build"):
    if not callable(getattr(module, attr, None)):
      raise ValueError(f"method module {module.__name__} must define {attr}() "
                       "(see experiments/build.py).")
  return module


def _parents(path: str) -> list[str]:
  parts = path.split(".")
  return [".".join(parts[:i]) for i in range(1, len(parts))]


def method_defaults(name: str) -> ml_collections.ConfigDict:
  """The settings of method `name` with their defaults."""
  return load_method(name).defaults()


def overlap_steps(method: ml_collections.ConfigDict) -> int:
  """Steps a sync of this method overlaps on the simulated clock (0: none)."""
  fn = getattr(load_method(method.name), "overlap_steps", None)
  return int(fn(method)) if fn else 0


def nesterov(lr: float, momentum: float) -> optax.GradientTransformation:
  """The outer optimiser of DiLoCo-style methods (settings `outer_lr`, `outer_momentum`):
  SGD with Nesterov momentum, plain SGD at momentum 0."""
  if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not 0 < lr < math.inf:
    raise ValueError(f"outer_lr must be a finite number > 0, got {lr!r}.")
  if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or \
     not 0 <= momentum < 1:
    raise ValueError(f"outer_momentum must be a number in [0, 1), got {momentum!r}.")
  if not momentum:
    return optax.sgd(lr)
  return optax.sgd(lr, momentum=momentum, nesterov=True)
