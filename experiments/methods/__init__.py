"""The methods `experiments.build` can run: one module per method, loaded by name.

Each module defines `defaults()` (its settings, the library factory's defaults read from its
signature) and `build(settings, ctx)` (the optax transform), and may define the optional
hooks of `Hooks` (experiments/methods/_hooks.py: each hook, what it takes and returns, its
default). Programs read a method's hooks through `hooks(name)`. A method of your own is one
such file anywhere (`config.method.name = "/path/to/my_method.py"`).
"""

from __future__ import annotations

import difflib
import functools
from types import ModuleType

import ml_collections

from .. import _plugins
from ._hooks import Hooks
from ._hooks import hooks as _read_hooks


def available_methods() -> list[str]:
  """The methods that ship in experiments/methods/."""
  return _plugins.available(__path__)


@functools.lru_cache(maxsize=None)
def load_method(name: str) -> ModuleType:
  """The module of method `name`: experiments/methods/<name>.py, a dotted module path, or a
  `.py` file path, its hooks checked (`hooks`). Raises a ValueError naming the method when
  there is none."""
  module = _plugins.load(name, __name__, "method", available_methods())
  _read_hooks(module)
  return module


def hooks(method: str | ModuleType) -> Hooks:
  """The hooks of a method (its name, as config.method.name, or its module), each the
  module's own or its default."""
  return _read_hooks(load_method(method) if isinstance(method, str) else method)


def method_defaults(name: str) -> ml_collections.ConfigDict:
  """The settings of method `name` with their defaults."""
  return load_method(name).defaults()


def settings(name: str, **given) -> ml_collections.ConfigDict:
  """config.method for method `name`: its defaults, then `given`, and its `name`.

  A setting the method does not have is an error naming it (a misspelt setting would
  otherwise be ignored).

  >>> s = settings("diloco", sync_every=5)
  >>> s.name, s.sync_every, s.outer_lr
  ('diloco', 5, 0.7)
  """
  c = method_defaults(name)
  unknown = sorted(set(given) - set(c.keys()))
  if unknown:
    close = difflib.get_close_matches(unknown[0], list(c.keys()), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"method {name!r} has no setting {', '.join(map(repr, unknown))}; its "
                     f"settings: {', '.join(sorted(c.keys()))}.{hint}")
  c.name = name
  c.update(given)
  return c


__all__ = ["Hooks", "available_methods", "hooks", "load_method", "method_defaults", "settings"]
