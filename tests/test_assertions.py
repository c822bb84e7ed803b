"""The test-quality gate: every test function under tests/ asserts something.

A test that asserts nothing passes whatever the code does. A test function counts as
asserting when its body (nested functions and lambdas included) contains an `assert`, a
`raise AssertionError`, a call of an assertion function (`np.testing.assert_*`,
`chex.assert_*`, any `assert...` name), a `pytest.raises` / `pytest.warns` / `pytest.fail`,
or a call of a helper that asserts, resolved transitively: a bare name defined in the same
file or imported from a tests/ module (`from test_validation import run_update`), or
`module.name` of an imported tests/ module (`contract.check_on_mesh`, `faults.restore`) or
of the contract checks jaxcomm ships for users (`jaxcomm/testing`, when it exists).
"""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
TESTING = TESTS.parent / "jaxcomm" / "testing"  # the shipped checks (a module or a package)
_PYTEST_ASSERTING = ("raises", "warns", "fail", "deprecated_call")


class _Module:
  """One parsed tests/ file: its functions, and where its imported names come from."""

  def __init__(self, name: str, source: str):
    self.name = name
    self.tree = ast.parse(source)
    self.functions = {}        # name -> [FunctionDef] (nested and methods too)
    self.imported_names = {}   # local name -> (module, name) for `from m import name`
    self.imported_modules = {}  # local name -> module for `import m` / `from tests import m`
    for node in ast.walk(self.tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        self.functions.setdefault(node.name, []).append(node)
      elif isinstance(node, ast.Import):
        for alias in node.names:
          self.imported_modules[alias.asname or alias.name] = alias.name
      elif isinstance(node, ast.ImportFrom) and node.module:
        for alias in node.names:  # `from m import x`: x may be a module or a function
          self.imported_modules[alias.asname or alias.name] = alias.name
          self.imported_names[alias.asname or alias.name] = (node.module.split(".")[-1],
                                                              alias.name)

  def collected(self):
    """The test functions pytest collects: module-level test_* and test_* of Test* classes."""
    out = []
    for node in self.tree.body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
         node.name.startswith("test"):
        out.append(node)
      elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
        out += [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                and f.name.startswith("test")]
    return out


def _asserts_directly(node) -> bool:
  for sub in ast.walk(node):
    if isinstance(sub, ast.Assert):
      return True
    if isinstance(sub, ast.Raise) and sub.exc is not None:
      exc = sub.exc.func if isinstance(sub.exc, ast.Call) else sub.exc
      if isinstance(exc, ast.Name) and exc.id == "AssertionError":
        return True
    if isinstance(sub, ast.Call):
      func = sub.func
      name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
      if name.startswith("assert"):
        return True
      if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
         func.value.id == "pytest" and func.attr in _PYTEST_ASSERTING:
        return True
  return False


def _callees(module: _Module, node) -> list:
  """(module name, function name) of every call in `node` that may reach a tests/ helper."""
  out = []
  for sub in ast.walk(node):
    if not isinstance(sub, ast.Call):
      continue
    func = sub.func
    if isinstance(func, ast.Name):
      if func.id in module.functions:
        out.append((module.name, func.id))
      elif func.id in module.imported_names:
        out.append(module.imported_names[func.id])
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
        func.value.id in module.imported_modules:
      out.append((module.imported_modules[func.value.id].split(".")[-1], func.attr))
  return out


def asserting_functions(modules: dict) -> set:
  """(module, name) of every helper that asserts, directly or through other helpers."""
  asserting = {(m.name, name) for m in modules.values() for name, defs in m.functions.items()
               if any(_asserts_directly(d) for d in defs)}
  changed = True
  while changed:
    changed = False
    for m in modules.values():
      for name, defs in m.functions.items():
        if (m.name, name) in asserting:
          continue
        if any(c in asserting for d in defs for c in _callees(m, d)):
          asserting.add((m.name, name))
          changed = True
  return asserting


def unasserted_tests(sources: dict) -> list:
  """`file::test` of every test function in `sources` ({module name: source}) that asserts
  nothing, directly or through a helper."""
  modules = {name: _Module(name, src) for name, src in sources.items()}
  asserting = asserting_functions(modules)
  bad = []
  for m in modules.values():
    if not m.name.startswith("test_"):
      continue
    for test in m.collected():
      if not _asserts_directly(test) and not any(c in asserting for c in _callees(m, test)):
        bad.append(f"{m.name}.py::{test.name}")
  return bad


def _sources() -> dict:
  sources = {p.stem: p.read_text(encoding="utf-8") for p in sorted(TESTS.glob("*.py"))}
  kit = sorted(TESTING.glob("*.py")) + [p for p in [TESTING.with_suffix(".py")] if p.is_file()]
  if kit:  # one module `testing`, whatever files it is split into
    sources["testing"] = "\n".join(p.read_text(encoding="utf-8") for p in kit)
  return sources


def test_every_test_function_asserts_something():
  bad = unasserted_tests(_sources())
  assert not bad, "test functions that assert nothing (add an assertion):\n" + "\n".join(bad)


def test_the_gate_flags_a_test_without_assertions():
  """The gate itself can fail: an assertion-free test is reported, helpers are followed."""
  helpers = "def check(x):\n  assert x\n\ndef quiet(x):\n  return x\n"
  sources = {
      "helpers_mod": helpers,
      "test_sample": (
          "import numpy as np\nimport pytest\nfrom helpers_mod import check, quiet\n"
          "import helpers_mod\n\n"
          "def local(x):\n  np.testing.assert_allclose(x, 1)\n\n"
          "def test_prints():\n  print(quiet(1))\n\n"
          "def test_calls_quiet_helper():\n  helpers_mod.quiet(2)\n\n"
          "def test_plain_assert():\n  assert 1\n\n"
          "def test_imported_helper():\n  check(1)\n\n"
          "def test_module_helper():\n  helpers_mod.check(1)\n\n"
          "def test_local_helper():\n  local(1)\n\n"
          "def test_raises():\n  with pytest.raises(ValueError):\n    int('x')\n"),
  }
  assert unasserted_tests(sources) == ["test_sample.py::test_prints",
                                               "test_sample.py::test_calls_quiet_helper"]
