"""The methods `experiments.build` can run: one module per method, loaded by name.

Each module defines `defaults()` (its settings, the library factory's defaults read from its
signature) and `build(settings, ctx)` (the optax transform); optionally `wrap_loss` and
`overlap_steps`. See experiments/build.py for the contract; a method of your own is one such
file anywhere (`config.method.name = "/path/to/my_method.py"`).
"""

from __future__ import annotations

import functools
from types import ModuleType

import ml_collections

from .. import _plugins


def available_methods() -> list[str]:
  """The methods that ship in experiments/methods/."""
  return _plugins.available(__path__)


@functools.lru_cache(maxsize=None)
def load_method(name: str) -> ModuleType:
  """The module of method `name`: experiments/methods/<name>.py, a dotted module path, or a
  `.py` file path. Raises a ValueError naming the method when there is none."""
  return _plugins.load(name, __name__, "method", available_methods())


def method_defaults(name: str) -> ml_collections.ConfigDict:
  """The settings of method `name` with their defaults."""
  return load_method(name).defaults()


def overlap_steps(method: ml_collections.ConfigDict) -> int:
  """Steps a sync of this method overlaps on the simulated clock (0: none)."""
  fn = getattr(load_method(method.name), "overlap_steps", None)
  return int(fn(method)) if fn else 0
