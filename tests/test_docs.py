"""Every public function and class of jaxcomm has a docstring with a `>>>` example.

tests/test_doctests.py runs those examples; this test makes sure they exist.

Exempt, by rule (not by name):
* constants and type aliases (tuples, dicts, unions): they are data, not code;
* record classes, i.e. NamedTuples (optimiser states `...State`, results, `TrainState`) and
  dataclasses (reports, costs, layouts, `Codec`, Flax sub-modules such as `Block`): they
  are built by a public factory or function whose docstring shows them in use;
* exception and warning classes: raised or warned, never called by a user.
"""

import dataclasses
import importlib
import inspect

import pytest

import jaxcomm


def _is_record(obj):
  return inspect.isclass(obj) and (dataclasses.is_dataclass(obj) or
                                   (issubclass(obj, tuple) and hasattr(obj, "_fields")) or
                                   issubclass(obj, BaseException))


def _is_code(obj):
  # functools.lru_cache wrappers (data.digits, ...) count as functions.
  return inspect.isroutine(obj) or inspect.isclass(obj) or hasattr(obj, "__wrapped__")


def _public():
  out = []
  for sub in jaxcomm.__all__:
    module = importlib.import_module(f"jaxcomm.{sub}")
    for name in getattr(module, "__all__", ()):
      obj = getattr(module, name)
      if _is_code(obj) and not _is_record(obj):
        out.append((f"jaxcomm.{sub}.{name}", obj))
  return out


def test_every_subpackage_declares_all():
  for sub in jaxcomm.__all__:
    module = importlib.import_module(f"jaxcomm.{sub}")
    assert getattr(module, "__all__", None), f"jaxcomm.{sub} has no __all__"


@pytest.mark.parametrize("name,obj", _public(), ids=[n for n, _ in _public()])
def test_public_name_has_example(name, obj):
  doc = inspect.getdoc(obj) or ""
  assert ">>>" in doc, f"{name} has no docstring example (add a short `>>>` example)"
