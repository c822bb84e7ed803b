"""Every docstring example in jaxcomm runs (on the 8 emulated devices set in conftest)."""

import doctest
import importlib
import pkgutil

import pytest

import jaxcomm


def _modules():
  names = ["jaxcomm"]
  for info in pkgutil.walk_packages(jaxcomm.__path__, "jaxcomm."):
    names.append(info.name)
  return sorted(names)


@pytest.mark.parametrize("name", _modules())
@pytest.mark.slow
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"
