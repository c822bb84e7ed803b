"""The command-line programs as a new user meets them: a misspelt mesh axis, the README's
own-data command with dropout and its resume, ratios against DP on the same mesh, and one
line for every mistake in a setting or flag."""

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys

import jax
import pytest

from experiments import build
from experiments import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_misspelt_mesh_axis_is_refused_before_anything_compiles():
  c = config.base_config("diloco", sync_every=10)
  c.mesh = "replica=2,fdsp=2,tensor=2"
  with pytest.raises(ValueError, match=re.escape(
      "config.mesh 'replica=2,fdsp=2,tensor=2': unknown axis 'fdsp' (did you mean 'fsdp'?)")):
    build.build(c, abstract=True)
  c.mesh = "replica=2,workers=4"
  with pytest.raises(ValueError, match="unknown axis 'workers'; allowed: replica, data"):
    build.build(c, abstract=True)


def _tiny_lm(c):
  c.model.update(d_model=16, num_heads=2, d_ff=32, num_layers=1)
  c.data.update(seq_len=16, batch_size=8)
  c.checkpoint_every, c.log_every = 0, 10
  return c


@pytest.mark.slow
def test_ratios_on_a_replica_mesh_are_against_dp_on_that_mesh(tmp_path):
  """On replica=2,fsdp=2,tensor=2 DP's printed ratio is 1.00x and DiLoCo H = 4's 4.00x in
  the steady state: both against DP's compiled step over `replica` on the same mesh (a
  replica's gradient is reduce-scattered over fsdp first, so DP sends a quarter of the
  parameters over replica); DiLoCo sends the same all-reduce once in 4 steps, and once in
  this run's 6 steps (6.00x, in brackets). The headline bytes are every axis's: the
  tensor axis's activations (which no optimiser counts) included."""
  from experiments import train
  printed = {}
  for method, settings, steps in (("dp", {}, 1), ("diloco", {"sync_every": 4}, 6)):
    c = _tiny_lm(config.base_config(method, **settings))
    c.mesh, c.steps = "replica=2,fsdp=2,tensor=2", steps
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      assert train.execute(c, str(tmp_path / method)) == 0
    printed[method] = out.getvalue()
    summary = json.loads((tmp_path / method / "summary.json").read_text())
    assert summary["method_axes"] == ["replica"]
  assert re.search(r"DP bytes / bytes \(over replica\)\s+1\.00x \(every step sends the same\)",
                   printed["dp"]), printed["dp"]
  assert re.search(r"DP bytes / bytes \(over replica\)\s+4\.00x steady state, whole periods "
                   r"of 4 steps \(this run's 6 steps: 6\.00x\)", printed["diloco"]), \
      printed["diloco"]
  # DP's own ratio is its compiled replica bytes over themselves, not over a formula.
  dp = json.loads((tmp_path / "dp" / "summary.json").read_text())
  assert dp["dp_wire_bytes_per_step"] == dp["method_wire_bytes_per_step"] > 0
  diloco = json.loads((tmp_path / "diloco" / "summary.json").read_text())
  assert diloco["compression_ratio"] == pytest.approx(6.0)
  assert diloco["steady_state"]["period_steps"] == 4
  assert diloco["steady_state"]["compression_ratio"] == pytest.approx(4.0)
  # Every axis: per block, 5 all-reduces over tensor (T = 2) of the activations
  # f32[B / (R F), seq, d] = 2 x 16 x 16 x 4 bytes (Megatron's forward and backward, and the
  # attention's again in FSDP's recomputation), 2 (T-1)/T x 2,048 each; no optimiser counts
  # them, so the counted bytes are the other axes' and the label says so.
  by_axis = diloco["step_wire_bytes_by_axis"]
  assert by_axis["tensor"] == 5 * 2 * 16 * 16 * 4 == 10_240
  assert diloco["step_wire_bytes_per_step"] == pytest.approx(sum(by_axis.values()))
  assert diloco["wire_bytes_per_step"] == pytest.approx(by_axis["replica"] + by_axis["fsdp"])
  assert diloco["counted_axes"] == ["replica", "fsdp"]
  every = f"{diloco['step_wire_bytes_per_step']:,.0f}"
  assert re.search(rf"wire bytes, mean per step\s+{every} \(compiled step, every axis\)",
                   printed["diloco"]), printed["diloco"]
  assert "(over replica, fsdp; not the model's own on tensor)" in printed["diloco"]


def test_a_run_without_a_sync_prints_no_infinite_ratio():
  """A run shorter than its sync period sent nothing over the method's axes: the ratio says
  so (and summary.json holds None), next to the steady state's."""
  from experiments import train
  text = train._ratio_text(None, 4.0, 4, 3, "data")
  assert text == "4.00x steady state, whole periods of 4 steps (this run's 3 steps: nothing " \
      "sent over data)"
  text = train._ratio_text(None, None, None, 3, "data")
  assert "inf" not in text and text.startswith("nothing sent over data in this run's 3 steps")


def test_the_dp_reference_compiles_the_global_batch_of_a_multi_process_run(monkeypatch):
  """Each process builds its share of the batch (24 rows over 3 processes: 8); the DP
  reference must compile the global 24 rows on the 3-device mesh, not 8 rows (which 3 devices
  cannot split: a 3-process run used to fail at its summary)."""
  from experiments import _reference
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  c = config.base_config("dp")
  c.model.name, c.data.name, c.data.batch_size, c.mesh = "mlp", "digits", 24, "data=3"
  step, run = _reference.step_plan(c, jax.devices()[:3])
  assert jax.tree.leaves(run.batches(0))[0].shape[0] == 8  # this process's share
  assert step.state_bytes["batch"] == 24 // 3 * (64 * 4 + 4)  # x: 64 f32, y: one int32


def _readme_command() -> list:
  """The README's command-line block under "Your own model, data and dashboard"."""
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  section = text[text.index("## Your own model, data and dashboard"):]
  block = section[section.index("```bash") + len("```bash"):]
  block = block[:block.index("```")]
  return shlex.split(block.replace("\\\n", " "))


@pytest.mark.slow
def test_the_readme_own_data_command_with_dropout_runs_and_resumes(tmp_path):
  """The block exactly as written (its folder and workdir pointed at the test's): the NNX LM
  with dropout (an RNG key in the model's state) trains, summarises and resumes. The first
  run stops early (a smaller `steps`, which a resumed run may extend); the second is the
  README's command and resumes from the first run's checkpoint."""
  texts = tmp_path / "texts"
  texts.mkdir()
  for name in ("json", "tempfile"):
    module = __import__(name)
    (texts / f"{name}.py").write_text(open(module.__file__, encoding="utf-8").read())
  argv = [a.replace("/path/to/your/texts", str(texts)).replace("runs/own",
                                                                 str(tmp_path / "own"))
          for a in _readme_command()]
  assert argv[:3] == ["python", "-m", "experiments.train"], argv
  steps = int(next(a for a in argv if a.startswith("--config.steps=")).split("=")[1])
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  for extra in ([f"--config.steps={steps // 2}"], []):
    result = subprocess.run([sys.executable, *argv[1:], *extra], capture_output=True,
                            text=True, cwd=ROOT, env=env, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "own" / "summary.json").read_text())
    assert summary["steps"] == (steps // 2 if extra else steps)
    assert summary["compression_ratio"] == pytest.approx(10.0, rel=1e-3)  # sync_every=10
  assert "resum" in result.stderr + result.stdout


# ---------------------------------------------------------------- one line per mistake
def _leaves(tree, prefix=""):
  for key in tree.keys():
    value = tree[key]
    if hasattr(value, "keys"):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def _parse(argv, define=None):
  """train.py's command line (or that of the program whose flags `define(flag_values)`
  defines, returning the config's holder), parsed in-process with the programs' own
  parser: the config (with its overrides) or the SystemExit the program would end with."""
  from absl import flags
  from experiments import _cli
  fv = flags.FlagValues()
  saved, sys.argv = sys.argv, ["program.py", *argv]
  try:
    if define is None:
      holder = _cli.config_flag(f"{ROOT}/experiments/configs/dp.py", "the config", fv)
    else:
      holder = define(fv)
    _cli.parse_flags(sys.argv, fv)
    return holder.value
  finally:
    sys.argv = saved


def _cases():
  """(method, flag, why) for every leaf of base_config and of every method's settings:
  its name misspelt, a value of the wrong type, a value out of range."""
  cases = []
  for method in build.available_methods():
    c = config.base_config(method)
    for path, value in _leaves(c):
      if path == "method.name" or (method != "dp" and not path.startswith("method.")):
        continue  # the shared leaves once (with dp), each method's own for every method
      leaf = path.rsplit(".", 1)[-1]
      cases.append((method, f"--config.{path[:-len(leaf)]}{leaf[:-1]}x{leaf[-1]}=1", "name"))
      if isinstance(value, (bool, int, float)) or value is None:
        cases.append((method, f"--config.{path}=[oops]", "type"))
      if isinstance(value, bool):
        continue
      bad = -1 if isinstance(value, (int, float)) else "zz!"
      cases.append((method, f"--config.{path}={bad}", "range"))
  return cases


def test_every_setting_misspelt_mistyped_or_out_of_range_is_one_line(tmp_path):
  """Every leaf of base_config and of every method's settings, through the parser train.py
  uses and the checks it runs before writing anything: a misspelt name or a wrong type ends
  with one line naming the setting; a value out of range either builds (nothing compiled)
  or ends with one line naming it; nothing else escapes (no traceback); nothing is written."""
  from experiments import _cli
  wrong, counts = [], {"name": 0, "type": 0, "range": 0, "built": 0}
  for method, flag, why in _cases():
    argv = [f"--config={ROOT}/experiments/configs/{method}.py", flag]
    setting = flag.split("=", 1)[0][len("--config."):].rsplit(".", 1)[-1]
    try:
      c = _parse(argv)
      _tiny_lm(c)
      try:
        run = build.build(c, abstract=True)
        del run
      except ValueError as e:  # what execute() turns into one line before writing
        message = _cli.one_line(e)
      else:
        counts["built"] += 1
        continue
    except SystemExit as e:
      message = str(e.code)
      assert message.startswith("error: "), (flag, message)
    except Exception as e:
      wrong.append((method, flag, f"escaped: {type(e).__name__}: {e}"))
      continue
    counts[why] += 1
    if "\n" in message or "Traceback" in message or (why != "name" and setting not in message):
      wrong.append((method, flag, message))
    elif why == "name" and "no such setting" not in message:
      wrong.append((method, flag, message))
  assert not wrong, "\n".join(map(str, wrong[:20]))
  assert counts["name"] > 100 and counts["type"] > 50 and counts["range"] > 20, counts
  assert not list(tmp_path.iterdir())


def test_a_bad_default_py_name_is_one_line():
  with pytest.raises(SystemExit) as e:
    _parse([f"--config={ROOT}/experiments/configs/default.py:dilocoo"])
  assert str(e.value.code).startswith("error: flag --config=") and \
      "config.method.name must be one of 'acco'" in str(e.value.code)
  assert "\n" not in str(e.value.code)


# ---------------------------------------------------------------- the reproductions
REPRODUCTIONS = ("demo", "diloco", "powersgd", "topk", "streaming")


def _reproduction(program):
  from experiments.reproduce import _reproduce
  return lambda fv: _reproduce.define_flags(program, fv)


def test_every_reproduction_has_its_config_and_nothing_else_does():
  names = {f[:-3] for f in os.listdir(f"{ROOT}/experiments/reproduce")
           if f.endswith(".py") and not f.startswith("_")}
  configs = {f[:-3] for f in os.listdir(f"{ROOT}/experiments/configs/reproduce")
             if not f.startswith("__")}
  assert names == configs == set(REPRODUCTIONS)


@pytest.mark.parametrize("program", REPRODUCTIONS)
def test_a_misspelt_or_mistyped_reproduction_setting_is_one_line_naming_it(program):
  """Each of the reproduction's own settings (config.reproduce, experiments/configs/
  reproduce/<program>.py) misspelt, and given a value of the wrong type, through the parser the
  program uses: one line naming it (with ml_collections' "Did you mean" for a misspelling)."""
  from experiments.reproduce import _reproduce
  own = _reproduce.load(program).reproduce
  for name in own.keys():
    wrong = name + name[-1]  # hs -> hss
    hint = (f'Did you mean "{name}"',) if len(name) > 2 else ()  # ml_collections' difflib
    for flag, words in ((f"--config.reproduce.{wrong}=1", (f"no such setting {wrong!r}", *hint)),
                        (f"--config.reproduce.{name}=[oops", (f"--config.reproduce.{name}",))):
      if flag.endswith("[oops") and isinstance(own[name], tuple):
        continue  # a tuple takes any text; the program checks its items (below)
      with pytest.raises(SystemExit) as e:
        _parse([flag], _reproduction(program))
      message = str(e.value.code)
      assert message.startswith("error: ") and "\n" not in message, (flag, message)
      assert all(w in message for w in words), (flag, message)


def test_reproduction_overrides_reach_the_runs_and_a_bad_sweep_is_refused(tmp_path):
  """Overrides are typed and reach what the runs read (a tuple written 4,8; the LM's MLP
  follows its width as the old --d_model did); a sweep value out of range is a ValueError
  naming it (one line under _cli.run) before anything trains or is written."""
  from experiments import _cli
  from experiments.reproduce import _reproduce
  from experiments.reproduce import diloco as reproduce_diloco
  c = _parse(["--config.reproduce.hs=4,8", "--config.model.d_model=32",
              "--config.data.batch_size=8"], _reproduction("diloco"))
  c = c.copy_and_resolve_references()
  assert c.reproduce.hs == (4, 8) and c.model.d_ff == 128
  assert c.reproduce.warm_start_batch == 8 and c.steps == 150
  run = _reproduce.config(c, "diloco", sync_every=4)
  assert "hs" not in run.reproduce and run.method.sync_every == 4  # one run: no sweep
  for flag in ("--config.reproduce.hs=0,4", "--config.reproduce.hs=a"):
    c = _parse([flag], _reproduction("diloco"))
    with pytest.raises(ValueError, match=r"config\.reproduce\.hs must be") as e:
      reproduce_diloco.run(c.copy_and_resolve_references(), str(tmp_path / "run"))
    assert "\n" not in _cli.one_line(e.value)
  assert not list(tmp_path.iterdir())


# Programs on `--config.<path>` settings through `_cli.run(main, get_config(), **flags)` (the
# studies and benchmarks) or `_reproduce.main(name, run)` (the reproductions).
SETTINGS_PROGRAMS = (
    *(f"experiments.reproduce.{name}" for name in REPRODUCTIONS),
    "experiments.replica_periods", "experiments.heterogeneous", "experiments.compression_table",
    "experiments.elastic_goodput", "experiments.failure_replay", "experiments.failure_scale",
    "benchmarks.codec_table",
    "benchmarks.fit_speed", "benchmarks.layouts", "benchmarks.overhead", "benchmarks.population",
    "benchmarks.profile_step", "benchmarks.replicas")


def _program(module_name):
  """A function defining `module_name`'s command line on a FlagValues, as its `if __name__
  == "__main__"` line does (its keyword arguments read from the source)."""
  import ast
  import importlib
  import inspect
  from experiments import _cli
  if module_name.startswith("experiments.reproduce."):
    return _reproduction(module_name.rsplit(".", 1)[1])
  module = importlib.import_module(module_name)
  guard = [node for node in ast.parse(inspect.getsource(module)).body
           if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
  call = guard[0].body[-1].value
  assert ast.unparse(call.func) == "_cli.run", module_name
  assert ast.unparse(call.args[1]) == "get_config()", module_name
  kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
  return lambda fv: _cli.program_flags(module.get_config(), flag_values=fv, **kwargs)


def _documented_commands():
  """(program, argv, where) of every `python -m <program> ...` written in README.md, docs/,
  experiments/RESULTS.md and the programs' own docstrings, for SETTINGS_PROGRAMS."""
  paths = ["README.md", "experiments/RESULTS.md", "CONTRIBUTING.md"]
  paths += [f"docs/{f}" for f in os.listdir(f"{ROOT}/docs") if f.endswith(".md")]
  paths += [m.replace(".", "/") + ".py" for m in SETTINGS_PROGRAMS]
  found = []
  for path in paths:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      text = f.read().replace("\\\n", " ")
    for m in re.finditer(r"python -m ((?:experiments|benchmarks)(?:\.\w+)+)([^\n`]*)", text):
      if m.group(1) in SETTINGS_PROGRAMS:
        found.append((m.group(1), shlex.split(m.group(2), comments=True), path))
  return found


def test_every_documented_command_of_a_settings_program_parses():
  """The commands as written (settings' names and types, the flags beside --config) parse
  with each program's own command line, in-process: nothing runs."""
  commands = _documented_commands()
  wrong = []
  for program, argv, where in commands:
    try:
      _parse(argv, _program(program))
    except SystemExit as e:
      wrong.append((where, program, argv, str(e.code)))
  assert not wrong, "\n".join(map(str, wrong))
  written = {program for program, _, _ in commands}
  assert written == set(SETTINGS_PROGRAMS), set(SETTINGS_PROGRAMS) - written
  assert any("--config.reproduce.warm_start_steps=150" in argv for _, argv, _ in commands)


@pytest.mark.parametrize("program", SETTINGS_PROGRAMS)
def test_help_lists_every_setting_of_a_settings_program(program):
  """`--help` shows `--config` with each of the program's own settings and its default (the
  reproductions: those under `reproduce`, beside the shared sizes)."""
  import importlib
  from absl import flags
  from experiments import _cli
  from experiments.reproduce import _reproduce
  fv = flags.FlagValues()
  _program(program)(fv)
  text = " ".join(fv["config"].help.split())
  if program.startswith("experiments.reproduce."):
    own = _reproduce.load(program.rsplit(".", 1)[1]).reproduce
    listed = _cli.settings(own, "reproduce.").split(", ") + ["steps=", "model.d_model="]
  else:
    listed = _cli.settings(importlib.import_module(program).get_config()).split(", ")
  assert all(item in text for item in listed), (listed, text)


@pytest.mark.slow
def test_the_programs_exit_1_with_one_line_and_help_lists_config(tmp_path):
  """The real exit status and stderr of plan.py for a bad default.py:NAME (nothing written),
  and train.py's --help: --config, how overrides are written, --verbose."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "experiments.plan",
       f"--config={ROOT}/experiments/configs/default.py:dilocoo",
       f"--workdir={tmp_path / 'plan'}"], capture_output=True, text=True, cwd=ROOT,
      env=env, timeout=300, check=False)
  assert result.returncode == 1
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert "got 'dilocoo'" in result.stderr and not (tmp_path / "plan").exists()
  usage = subprocess.run([sys.executable, "-m", "experiments.train", "--help"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
                         check=False).stdout
  for words in ("--config:", "--config.<path>=<value>", "--[no]verbose:", "--workdir:"):
    assert words in usage, (words, usage[-3000:])
