"""Loading a plug-in module (a method, a model) by name: no registry, nothing runs at import.

A name is a module of the package (`diloco`, `lm`), a dotted module path (`my_pkg.my_model`)
or the path of a `.py` file, loaded with importlib.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from types import ModuleType


def available(package_path) -> list[str]:
  """The public modules of a package's folder (names not starting with '_')."""
  return sorted(m.name for m in pkgutil.iter_modules(package_path) if not m.name.startswith("_"))


def load(name: str, package: str, kind: str, shipped: list[str]) -> ModuleType:
  """The module `name` of `package` (`kind`: 'method' or 'model', for config.<kind>.name),
  a dotted module path or a `.py` file; it must define defaults() and build(). Raises a
  ValueError naming the setting when there is none."""
  setting = f"config.{kind}.name"
  allowed = f"{', '.join(map(repr, shipped))}, a module path or a .py file"
  if not isinstance(name, str) or not name:
    raise ValueError(f"{setting} must be one of {allowed}; got {name!r}.")
  if name.endswith(".py"):
    if not os.path.isfile(name):
      raise ValueError(f"{setting} {name!r}: no such file.")
    module_name = f"jaxcomm_{kind}_" + os.path.splitext(os.path.basename(name))[0]
    spec = importlib.util.spec_from_file_location(module_name, name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
  else:
    path = name if "." in name else f"{package}.{name}"
    try:
      module = importlib.import_module(path)
    except ModuleNotFoundError as e:
      if e.name not in (path, *_parents(path)):
        raise  # the module exists but one of its own imports is missing
      raise ValueError(f"{setting} must be one of {allowed}; got {name!r}.") from None
  for attr in ("defaults", "build"):
    if not callable(getattr(module, attr, None)):
      raise ValueError(f"{kind} module {module.__name__} must define {attr}() "
                       "(see experiments/build.py).")
  return module


def _parents(path: str) -> list[str]:
  parts = path.split(".")
  return [".".join(parts[:i]) for i in range(1, len(parts))]
