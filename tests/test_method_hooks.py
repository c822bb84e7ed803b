"""A method module's hooks: one record (`experiments.methods.Hooks`) with their defaults, read
by every program through `hooks()`; an unknown public function of a module is an error naming
it; the period hook sets an elastic run's rounds. Nothing compiles here."""

import ast
import dataclasses
import pathlib
import textwrap

import pytest

from experiments import config
from experiments import elastic_run
from experiments import methods

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOOKS = [f.name for f in dataclasses.fields(methods.Hooks)]

# Methods that sync every `sync_every` steps define `period`; these have a `sync_every`
# setting yet send something every step.
EVERY_STEP = {"dreamddp": "one group of layers each step"}


def _module(tmp_path, body: str, name: str = "my_method"):
  path = tmp_path / f"{name}.py"
  path.write_text(textwrap.dedent('''
      import ml_collections
      import optax

      def defaults():
        return ml_collections.ConfigDict({"sync_every": 4})

      def build(settings, ctx):
        return optax.identity()
      ''') + textwrap.dedent(body))
  return str(path)


def test_a_module_without_optional_hooks_gets_the_documented_defaults(tmp_path):
  h = methods.hooks(_module(tmp_path, ""))
  s = h.defaults()
  loss = lambda p, b: 0.0
  assert h.wrap_loss(s, loss, None) is loss
  assert (h.period(s), h.overlap_steps(s), h.overlap_backward(s), h.local_step(s),
          h.tuning()) == (1, 0, False, None, [{}])


def test_a_misspelt_hook_is_an_error_naming_it_and_the_hook_meant(tmp_path):
  path = _module(tmp_path, "def overlap_step(settings):\n  return 1\n", "misspelt")
  with pytest.raises(ValueError, match=r"defines overlap_step\(\), which is no hook.*Did you "
                     r"mean overlap_steps\(\)\?"):
    config.base_config(path)
  helper = _module(tmp_path, "def _helper():\n  return 1\nLIMIT = 3\n", "with_helper")
  assert methods.hooks(helper).period(None) == 1  # private helpers and constants are fine


def test_a_hook_that_is_not_a_function_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="period must be a function, got 5"):
    methods.hooks(_module(tmp_path, "period = 5\n", "not_callable"))


def test_the_period_hook_sets_an_elastic_runs_rounds(tmp_path):
  path = _module(tmp_path, "def period(settings):\n  return settings.sync_every\n", "mine")
  c = config.base_config(path, sync_every=6)
  assert elastic_run.round_steps(c.method) == 6
  assert elastic_run.round_steps(config.base_config("muloco", sync_every=12).method) == 12
  with pytest.raises(ValueError, match="period of method .* must be an integer >= 1"):
    elastic_run.round_steps(config.base_config(path, sync_every=0).method)


def test_every_shipped_method_with_a_sync_period_declares_it():
  periodic = []
  for name in methods.available_methods():
    s = config.base_config(name).method
    period = methods.hooks(name).period(s)
    if "sync_every" in s and name not in EVERY_STEP:
      assert period == s.sync_every, name
      periodic.append(name)
    else:
      assert period == 1, name
  assert {"diloco", "local_sgd", "streaming_diloco", "muloco", "noloco"} <= set(periodic)


def test_every_hook_is_documented_in_the_record():
  doc = methods.Hooks.__doc__.split("Attributes:")[1]
  assert all(f"    {name}: " in doc for name in HOOKS), HOOKS


def test_no_program_reads_a_method_module_by_getattr():
  """The programs read hooks through the record: a getattr (or hasattr) of a hook's name
  anywhere in experiments/ or benchmarks/ would bypass its default."""
  found = []
  for path in [*ROOT.glob("experiments/**/*.py"), *ROOT.glob("benchmarks/*.py")]:
    if path.name == "_hooks.py":
      continue
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
          and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
          and node.args[1].value in HOOKS):
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.args[1].value}")
  assert not found, found


@pytest.mark.parametrize("module", ["experiments.toolkit", "experiments.specs",
                                    "experiments.config", "experiments.methods._hooks",
                                    "experiments.elastic_run"])
def test_the_examples_of_what_a_plugin_author_reads_run(module):
  import doctest
  import importlib
  result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
  assert result.attempted and not result.failed, result
