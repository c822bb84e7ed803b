"""Every program's command line, in-process: the examples its `--help` shows parse with its own
flags; method settings reach train, compare and plan; config names resolve; and a fuzz over
every program's flags finds no traceback.

A program is run as its own `__main__` (runpy) with its flags defined on a fresh FlagValues,
and its `main` called with the heavy steps replaced by a sentinel: compiling or running a
jitted function, starting a process. A flag value that reaches one was accepted; a mistake
must end the program first, as one line (a ValueError or `error: ...`), never a traceback.
"""

import ast
import os
import pathlib
import random
import re
import shlex

import ml_collections
import pytest
from absl import flags

from experiments import _cli
from experiments import _config_file
from experiments import _main
from experiments import config as config_lib
from experiments.reproduce import _reproduce
from programs import MY_METHOD, Program, outcome, sandbox_patches

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROGRAMS = list(_main.PROGRAMS)
# runpy warns when it runs a module that is imported already: each program is, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of")


@pytest.fixture
def sandbox(monkeypatch, tmp_path):
  """tests/programs.py's sandbox; files go to tmp_path."""
  monkeypatch.chdir(tmp_path)
  sandbox_patches(monkeypatch)
  return monkeypatch


# ---------------------------------------------------------------- the three named tracebacks
def test_a_missing_config_file_is_one_line(sandbox):
  result = outcome("train", ["--config=experiments/configs/nope.py"])
  assert result.startswith("error: flag --config=experiments/configs/nope.py: no such config "
                           "file") and "diloco" in result, result


def test_a_mesh_axis_of_size_zero_is_one_line(sandbox):
  result = outcome("plan", ["--mesh=data=0"])
  assert result == ("error: --mesh 'data=0': the size of mesh axis 'data' must be an integer "
                    ">= 1, got 0."), result


def test_a_kill_of_a_process_that_does_not_exist_is_one_line(sandbox):
  result = outcome("launch_local", ["--kill=5@40"])
  assert result == ("error: --kill: process must be in [0, 2) and step >= 0; got '5@40'."), \
      result


# ---------------------------------------------------------------- method settings, config names
def _parsed(name: str, argv: list):
  program = Program(name, argv)
  try:
    program.parse()
    return program.fv["config"].value
  finally:
    program.close()


def test_selecting_a_method_by_name_brings_its_settings(sandbox):
  c = _parsed("train", ["--config.method.name=diloco", "--config.method.sync_every=20"])
  assert (c.method.name, c.method.sync_every, c.method.outer_lr) == ("diloco", 20, 0.7)
  c = _parsed("train", ["--config=diloco", "--config.method.name=diloco"])
  assert c.method.sync_every == 50  # the config file's own setting of the same method stays
  with pytest.raises(SystemExit) as e:
    _parsed("train", ["--config.method.sync_every=20"])
  assert "select it with --config.method.name=NAME" in str(e.value.code) and \
      "diloco" in str(e.value.code) and "\n" not in str(e.value.code)


def test_compare_and_plan_take_method_settings_and_name_a_misspelt_one(sandbox, tmp_path):
  argv = ["--config.method.sync_every=50"]
  given = _cli.method_settings(_parsed("compare", argv), argv)
  assert given == {"sync_every": 50}
  entries = config_lib.with_settings({"dp": {"method": "dp"},
                                      "h10": {"method": "diloco", "sync_every": 10}}, given)
  assert entries == {"dp": {"method": "dp"}, "h10": {"method": "diloco", "sync_every": 50}}
  argv = ["--config.method.outer_lr=0.5"]
  assert _cli.method_settings(_parsed("plan", argv), argv) == {"outer_lr": 0.5}
  mine = tmp_path / "my_method.py"
  mine.write_text(MY_METHOD)
  argv = [f"--methods=dp_bf16,{mine}", "--config.method.clip=0.5"]
  assert _cli.method_settings(_parsed("compare", argv), argv) == {"clip": 0.5}
  with pytest.raises(SystemExit) as e:
    _parsed("compare", [f"--methods=dp_bf16,{mine}", "--config.method.clipp=0.5"])
  assert 'no such setting \'clipp\'. Did you mean "clip"' in str(e.value.code)
  with pytest.raises(ValueError, match=r"--config.method.clip: none of the methods run "
                     r"\(dp\) has this setting"):
    config_lib.with_settings({"dp": {"method": "dp"}}, {"clip": 0.5})


@pytest.mark.parametrize("value,method", [
    ("diloco", "diloco"), ("default.py:local_sgd", "local_sgd"), ("reproduce/topk", "dp"),
    ("experiments/configs/noloco.py", "noloco")])
def test_config_names_resolve_inside_the_package_from_anywhere(value, method, monkeypatch,
                                                               tmp_path):
  monkeypatch.chdir(tmp_path)  # no experiments/ here: the names are the package's
  assert _config_file.load(value).method.name == method


# ---------------------------------------------------------------- --help examples and the fuzz
def _help_examples(name: str) -> list:
  """The flags of every `python -m experiments.<name> ...` line of a program's `--help`
  (its docstring), and the override example `--help` prints under --config."""
  module = f"experiments.{name}"
  path = ROOT / (module.replace(".", "/") + (".py" if name != "compare" else "/__init__.py"))
  text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
  text = text.replace("\\\n", " ")
  examples = [shlex.split(m.group(1), comments=True) for m in
              re.finditer(rf"python -m {re.escape(module)}\b([^\n`]*)", text)]
  if name in ("train", "compare", "plan"):
    examples.append([a for a in re.findall(r"--config\.\S+=[^\s,]\S*", _cli.OVERRIDES)
                     if "<" not in a])
  return [[a for a in argv if not a.startswith("--workdir")] for argv in examples
          if "--" not in argv]  # launch_local's program flags after -- are train's


@pytest.mark.slow
@pytest.mark.parametrize("name", PROGRAMS)
def test_every_help_example_runs(name, sandbox, tmp_path):
  examples = _help_examples(name)
  assert examples or name.startswith("reproduce.") or name == "launch_local", name
  mine = tmp_path / "my_method.py"  # the examples' method of your own
  mine.write_text(MY_METHOD)
  examples = [[re.sub(r"/path(/to)?/my_method\.py", str(mine), a) for a in argv]
              for argv in examples]
  results = [(argv, outcome(name, argv)) for argv in examples]
  wrong = [(argv, r) for argv, r in results if r != "ok"]
  assert not wrong, wrong


_BAD = {"int": ["-1", "0"], "float": ["-1", "nan"], "string": ["", "nope:x=1", "data=0"],
        "comma separated list of strings": ["", "nope,1@2"], "multi_string": ["nope"]}


def _fuzz_cases(seed: int = 0) -> list:
  """(program, argv): each flag of each program with one bad value of its type (seeded), and
  bad --config values and overrides."""
  rng, cases = random.Random(seed), []
  for name in PROGRAMS:
    program = Program(name, [])
    program.close()
    own = {n: program.fv[n] for n in program.fv}
    for flag_name, flag in sorted(own.items()):
      if flag_name in ("verbose", "config") or "." in flag_name:
        continue
      kind = "multi_string" if isinstance(flag, flags.MultiFlag) else flag.flag_type()
      if kind in _BAD:
        cases.append((name, [f"--{flag_name}={rng.choice(_BAD[kind])}"]))
      elif kind.startswith("string enum"):
        cases.append((name, [f"--{flag_name}=nope"]))
    if "config" in program.fv:
      cases += [(name, [rng.choice(["--config=missing.py", "--config=default.py:nope"])]),
                (name, [rng.choice(["--config.steps=-1", "--config.nosuch=1",
                                    "--config.steps=x"])])]
  return cases


@pytest.mark.slow
def test_no_flag_value_of_any_program_ends_in_a_traceback(sandbox):
  cases = _fuzz_cases()
  assert len({name for name, _ in cases}) == len(PROGRAMS) and len(cases) > 60, cases
  found = [(name, argv, r) for name, argv in cases
           if (r := outcome(name, argv, seconds=10.0)).startswith("TRACEBACK")]
  assert not found, "\n".join(map(str, found))


def test_the_jaxcomm_command_runs_a_program_and_names_a_wrong_one(capsys):
  with pytest.raises(SystemExit) as e:
    _main.main(["jaxcomm", "trian"])
  assert str(e.value.code).startswith("error: jaxcomm: no program 'trian'") and \
      "Did you mean 'train'?" in str(e.value.code)
  with pytest.raises(SystemExit) as e:
    _main.main(["jaxcomm", "--help"])
  out = capsys.readouterr().out
  assert e.value.code == 0 and all(p in out for p in PROGRAMS), out
  assert os.path.isfile(ROOT / "LICENSE") and "Apache License" in (ROOT / "LICENSE").read_text()


def test_a_reproduction_takes_the_settings_of_the_methods_it_runs():
  argv = ["--config.method.outer_lr=0.5", "--config.method.sync_every=3"]
  c = _parsed("reproduce.diloco", argv)
  with c.unlocked():
    c.reproduce.method_settings = ml_collections.ConfigDict(_cli.method_settings(c, argv))
  run = _reproduce.config(c, "diloco", sync_every=10)  # the sweep's own value wins
  assert (run.method.outer_lr, run.method.sync_every) == (0.5, 10)
  assert "outer_lr" not in _reproduce.config(c, "dp").method
  with pytest.raises(SystemExit) as e:  # a setting of none of its methods
    _parsed("reproduce.diloco", ["--config.method.rank=4"])
  assert "no such setting 'rank'" in str(e.value.code)
