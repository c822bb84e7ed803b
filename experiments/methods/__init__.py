"""The methods `experiments.build` can run: one module per method, loaded by name.

Each module defines `defaults()` (its settings, the library factory's defaults read from its
signature) and `build(settings, ctx)` (the optax transform); optionally `wrap_loss` and
`overlap_steps`. See experiments/build.py for the contract; a method of your own is one such
file anywhere (`config.method.name = "/path/to/my_method.py"`).
"""

from __future__ import annotations

import functools
import math
import numbers
from types import ModuleType

import ml_collections
import optax

from experiments import _plugins


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
