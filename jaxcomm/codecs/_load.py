"""Codecs by name: the built-in factories, a module path or a `.py` file, and spec strings.

A codec spec is `name` or `name:arg,key=value,...`. `name` is a codec factory of
`jaxcomm.codecs` (`top_k`), a dotted module path (`my_pkg.my_codec`: the module's
`codec` function, or `my_pkg.codecs.sketch`: that function of the module), or the path of a
`.py` file defining `codec`; the arguments after the colon are handed to the factory, each
read as a Python literal where it is one (`8`, `0.5`, `true`, `none`) and as text otherwise.
A codec of your own is such a file or module; nothing is registered. Its factory returns a
`Codec`, or a factory `shapes -> Codec` (a per-tensor codec, see `for_tree`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from types import ModuleType
from typing import Any, Callable

from jaxcomm.codecs import _base, _dct, _quantize, _sparse
from jaxcomm.codecs._base import Codec
from jaxcomm.codecs._shaped import CodecLike

# The modules whose public functions returning a Codec are the built-in factories (a new
# module of codecs is added here; tests/test_codecs.py holds this list to `codecs.__all__`).
_FACTORY_MODULES = (_base, _dct, _quantize, _sparse)


def _returns_codec(fn: Callable) -> bool:
  ret = inspect.signature(fn).return_annotation
  return getattr(ret, "__name__", str(ret)).split(".")[-1].strip("'\"") == "Codec"


def names() -> list[str]:
  """The codec factories of `jaxcomm.codecs` by name: its public functions returning a Codec.

  >>> from jaxcomm import codecs
  >>> "top_k" in codecs.names(), "flatten" in codecs.names()
  (True, False)
  """
  return sorted(name for module in _FACTORY_MODULES for name, fn in vars(module).items()
                if not name.startswith("_") and inspect.isfunction(fn)
                and fn.__module__ == module.__name__ and _returns_codec(fn))


def _module_from_file(path: str) -> ModuleType:
  module_name = "jaxcomm_codec_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module
  spec.loader.exec_module(module)
  return module


def _allowed() -> str:
  return f"one of {', '.join(map(repr, names()))}, a module path or a .py file"


def _from_path(name: str) -> Callable:
  """`codec` of module `name`, or function `name` of module `name.rpartition('.')[0]`."""
  try:
    return getattr(importlib.import_module(name), "codec", None)
  except ModuleNotFoundError as e:
    if e.name != name and not name.startswith(f"{e.name}."):
      raise  # the module exists but one of its own imports is missing
  parent, _, attr = name.rpartition(".")
  try:
    return getattr(importlib.import_module(parent), attr, None)
  except ModuleNotFoundError as e:
    if e.name != parent and not parent.startswith(f"{e.name}."):
      raise
    raise ValueError(f"codec must be {_allowed()}; got {name!r}.") from None


def load(name: str) -> Callable[..., Codec]:
  """The codec factory called `name`: a factory of `jaxcomm.codecs`, a dotted module path or
  a `.py` file (see the module docstring). Raises a ValueError naming the codec when there is
  none.

  Args:
    name: "top_k", "my_pkg.my_codec" (its `codec`), "my_pkg.codecs.sketch" or
      "path/to/my_codec.py" (its `codec`).

  Returns:
    The factory: call it with the codec's arguments.

  >>> from jaxcomm import codecs
  >>> codecs.load("sign") is codecs.sign
  True
  """
  if not isinstance(name, str) or not name.strip():
    raise ValueError(f"codec must be {_allowed()}; got {name!r}.")
  return _load(name.strip())


@functools.lru_cache(maxsize=None)
def _load(name: str) -> Callable[..., Codec]:
  if name in names():
    return next(getattr(m, name) for m in _FACTORY_MODULES if hasattr(m, name))
  if name.endswith(".py"):
    if not os.path.isfile(name):
      raise ValueError(f"codec {name!r}: no such file.")
    factory = getattr(_module_from_file(name), "codec", None)
  elif "." in name:
    factory = _from_path(name)
  else:
    raise ValueError(f"codec must be {_allowed()}; got {name!r}.")
  if not callable(factory):
    raise ValueError(f"codec {name!r}: the module must define a function codec(...) that "
                     "returns a jaxcomm.codecs.Codec.")
  return factory


def _literal(text: str) -> Any:
  """'8' -> 8, '0.5' -> 0.5, 'true' -> True, 'none' -> None, anything else stays text."""
  low = text.strip().lower()
  if low in ("none", "null"):
    return None
  if low in ("true", "false"):
    return low == "true"
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text.strip()


def parse(spec: str | None, argument: str = "codec") -> CodecLike | None:
  """The codec of a spec string `name` or `name:arg,key=value,...` (see `load` for names);
  None, "" and "none" are no codec (None). A mistake is a ValueError naming `argument`.

  Args:
    spec: the spec string.
    argument: the setting or argument the spec came from, for the message.

  Returns:
    The `Codec` (or the factory `shapes -> Codec` a codec of your own may return), or None.

  >>> from jaxcomm import codecs
  >>> codecs.parse("top_k:fraction=0.01").name
  'top_k(0.01, chunk=None)'
  >>> codecs.parse("uniform:4,block=64").payload_bytes(64)
  36
  """
  if spec is None or str(spec).strip().lower() in ("", "none"):
    return None
  name, _, rest = str(spec).partition(":")
  try:
    factory = load(name)
  except ValueError as e:
    if str(e).startswith("codec must be"):  # an unknown name: say what a spec may be
      raise ValueError(f"{argument} must be {_allowed()}, as name or name:arg,key=value; got "
                       f"{spec!r}.") from None
    detail = str(e).removeprefix(f"codec {name.strip()!r}: ")
    raise ValueError(f"{argument} {spec!r}: {detail}") from None
  args, kwargs = [], {}
  for part in filter(None, (p.strip() for p in rest.split(","))):
    key, eq, value = part.partition("=")
    if eq:
      kwargs[key.strip()] = _literal(value)
    else:
      args.append(_literal(part))
  try:
    inspect.signature(factory).bind(*args, **kwargs)
  except TypeError as e:
    raise ValueError(f"{argument} {spec!r}: {e} (the arguments of codec {name}"
                     f"{inspect.signature(factory)}).") from None
  try:
    codec = factory(*args, **kwargs)
  except ValueError as e:
    raise ValueError(f"{argument} {spec!r}: {e}") from None
  if not (isinstance(codec, Codec) or callable(codec)):
    raise ValueError(f"{argument} {spec!r}: {name}(...) returned {type(codec).__name__}, not "
                     "a jaxcomm.codecs.Codec or a factory shapes -> Codec.")
  return codec
