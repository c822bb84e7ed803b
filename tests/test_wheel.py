"""The built wheel works on its own, outside the checkout.

The wheel is built from a copy of the source tree, installed into a fresh venv by the
quickstart notebook's setup cell (`JAXCOMM_PIP=<wheel>`, as a Colab user would), and then
the README's quickstart, `jaxcomm train` and `jaxcomm plan --help` (the console script) and
every `python -m experiments.<program>` command of the README (as `jaxcomm <program>`, parsed
and checked up to its first build, tests/programs.py) run from a directory that is not the
source tree and holds a folder `experiments/` of its own, with no PYTHONPATH: a module, config
or method file missing from the wheel, or a package name a local folder hides, fails here.
jax and the other dependencies are not downloaded again: the new venv sees this
interpreter's site-packages through a .pth file (appended after its own, so the wheel's
jaxcomm comes first).
"""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

import nbclient
import nbformat
import pytest
from test_notebooks import _manager_for  # the kernel on a given interpreter

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP = (".git", ".venv", ".cache", "runs", "build", "_build", "dist", "__pycache__", "*.egg-info",
        ".pytest_cache", ".hypothesis", "docs")

pytestmark = pytest.mark.slow


def _run(args, cwd, env, timeout=240, returncode=0):
  proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)
  assert proc.returncode == returncode, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  return proc.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
  """(python of a fresh venv without jaxcomm, the built wheel, an env without PYTHONPATH)."""
  tmp = tmp_path_factory.mktemp("wheel")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
  source = tmp / "src"  # a copy: the build writes build/ and *.egg-info beside the sources
  shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*SKIP))
  _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", str(tmp / "dist"), str(source)], tmp, env)
  wheel, = (tmp / "dist").glob("jaxcomm-*.whl")
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")],
                 check=True, timeout=120)
  python = tmp / "venv" / "bin" / "python"
  site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
              tmp, env).strip()
  deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
  pathlib.Path(site, "_jaxcomm_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
  work = tmp / "elsewhere"
  (work / "experiments").mkdir(parents=True)  # a user's own folder: it must hide nothing
  return python, wheel, env, work


@pytest.fixture(scope="module")
def installed(venv):
  """The quickstart notebook, run in the new venv: its setup cell installs the wheel."""
  python, wheel, env, work = venv
  nb = nbformat.read(ROOT / "colab" / "01_quickstart.ipynb", as_version=4)
  nb.cells.append(nbformat.v4.new_code_cell("print(jaxcomm.__file__)"))
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(work)}})
  client.kernel_manager_class = _manager_for(str(python))
  # The kernel's environment: no PYTHONPATH, the wheel to install, small settings.
  client.execute(env=dict(env, JAXCOMM_PIP=str(wheel), JAXCOMM_NB_STEPS="4",
                          MPLBACKEND="Agg"))  # raises CellExecutionError on a failing cell
  return nb


def test_the_notebook_installs_the_wheel_and_runs(venv, installed):
  python, _, _, _ = venv
  last = "".join(o.get("text", "") for o in installed.cells[-1].outputs).strip()
  assert pathlib.Path(last).is_relative_to(python.parent.parent), last  # the venv's jaxcomm
  errors = [o for c in installed.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors, errors


def test_installed_package_is_the_wheel_with_its_version(venv, installed):
  del installed
  python, wheel, env, work = venv
  out = _run([str(python), "-c", "import json, jaxcomm, jaxcomm.experiments as e; print(json."
              "dumps([jaxcomm.__file__, e.__file__, jaxcomm.__version__]))"], work, env)
  files = json.loads(out.splitlines()[-1])
  venv_dir = python.parent.parent
  assert all(pathlib.Path(f).is_relative_to(venv_dir) for f in files[:2]), files
  assert wheel.name.startswith(f"jaxcomm-{files[2]}-"), (wheel.name, files[2])
  site = pathlib.Path(files[0]).parent.parent
  assert not (site / "experiments").exists()  # no generic top-level package
  assert (site / f"jaxcomm-{files[2]}.dist-info" / "licenses" / "LICENSE").is_file()


def test_readme_quickstart_runs_from_the_wheel(venv, installed):
  """The README's Quickstart as written, in a fresh interpreter (the suite's only run of it:
  from the checkout it would check the same). It prints the loss and the counted bytes,
  then the inspect table with its total: the bytes counted in the state equal those read
  from the compiled program."""
  del installed
  python, _, env, work = venv
  text = (ROOT / "README.md").read_text()
  section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  (work / "quickstart.py").write_text(re.findall(r"```python\n(.*?)```", section, re.S)[0])
  out = _run([str(python), "quickstart.py"], work, env)
  first = out.splitlines()[0].split()
  loss, counted = float(first[0]), int(first[1])
  total = re.findall(r"^total\s+([\d,]+)\s*$", out, re.M)[-1]
  assert counted == int(total.replace(",", "")) > 0, out  # counted == read from the HLO
  assert 0 < loss < 10, out  # a byte-level LM starts near ln 256 = 5.5


def test_experiment_programs_run_from_the_wheel(venv, installed, tmp_path):
  """`jaxcomm train` finds its config and the method modules inside the wheel, and trains the
  README's model of your own, from a directory whose own `experiments/` folder hides
  nothing."""
  del installed
  python, _, env, work = venv
  jaxcomm = str(python.parent / "jaxcomm")
  _readme_commands(tmp_path)  # writes the README's my_model.py
  _run([jaxcomm, "train", "--config=experiments/configs/default.py:diloco",
        "--config.method.sync_every=2", "--config.steps=3", "--config.log_every=1",
        f"--config.model.name={tmp_path}/my_model.py", "--config.data.name=digits",
        "--workdir=runs/t"], work, env)
  rows = [json.loads(line) for line in (work / "runs/t/metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows][-1] == 3 and rows[-1]["total_wire_bytes"] > 0, rows
  saved = json.loads((work / "runs/t/config.json").read_text())["method"]
  assert (saved["name"], saved["sync_every"]) == ("diloco", 2), saved
  # absl ends --help with status 1, after the flags of the program (a failed import ends
  # before printing any).
  out = _run([jaxcomm, "plan", "--help"], work, env, returncode=1)
  assert "--model" in out and "--mesh" in out and "Try --helpfull" in out, out[-2000:]


def _readme_commands(folder: pathlib.Path) -> list:
  """(program, argv) of every `python -m experiments.<program> ...` in the README, its
  placeholder files made real in `folder` (the README's own method and model)."""
  text = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  (folder / "my_method.py").write_text(next(b for b in blocks if "my_method.py" in b))
  (folder / "my_model.py").write_text(next(b for b in blocks if "my_model.py:" in b))
  (folder / "texts").mkdir(exist_ok=True)
  found = []
  for m in re.finditer(r"python -m experiments\.([\w.]+)([^\n`]*)", text.replace("\\\n", " ")):
    argv = shlex.split(m.group(2), comments=True)
    argv = [re.sub(r"/path/to/(my_method|my_model)\.py", rf"{folder}/\1.py", a)
            .replace("/path/to/your/texts", str(folder / "texts")) for a in argv]
    found.append((m.group(1), argv))
  return found


def test_every_readme_command_works_from_the_wheel(venv, installed, tmp_path):
  """Each README command, as `jaxcomm <program> ...` with the installed package, parses and
  passes its program's checks up to its first build or compile (nothing trains)."""
  del installed
  python, _, env, work = venv
  commands = _readme_commands(tmp_path)
  assert len(commands) > 15 and {p for p, _ in commands} >= {"train", "compare", "plan"}
  script = ("import json, sys; sys.path.insert(0, sys.argv[1]); import programs; "
            "print(json.dumps(programs.check_commands('jaxcomm.experiments', "
            "json.loads(sys.argv[2]))))")
  out = _run([str(python), "-c", script, str(ROOT / "tests"), json.dumps(commands)], work,
             dict(env, JAX_PLATFORMS="cpu"))
  wrong = json.loads(out.strip().splitlines()[-1])
  assert not wrong, "\n".join(map(str, wrong))
