"""The built wheel works on its own, outside the checkout.

The wheel is built from a copy of the source tree, installed into a fresh venv by the
quickstart notebook's setup cell (`JAXCOMM_PIP=<wheel>`, as a Colab user would), and then
the README's quickstart, `python -m experiments.train` and `python -m experiments.plan --help`
run from a directory that is not the source tree, with no PYTHONPATH: a module, config or
method file missing from the wheel fails here. jax and the other dependencies are not
downloaded again: the new venv sees this interpreter's site-packages through a .pth file
(appended after its own, so the wheel's jaxcomm comes first).
"""

import json
import os
import pathlib
import re
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
  work.mkdir()
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
  out = _run([str(python), "-c", "import json, experiments, jaxcomm; print(json.dumps("
              "[jaxcomm.__file__, experiments.__file__, jaxcomm.__version__]))"], work, env)
  files = json.loads(out.splitlines()[-1])
  venv_dir = python.parent.parent
  assert all(pathlib.Path(f).is_relative_to(venv_dir) for f in files[:2]), files
  assert wheel.name.startswith(f"jaxcomm-{files[2]}-"), (wheel.name, files[2])


def test_readme_quickstart_runs_from_the_wheel(venv, installed):
  del installed
  python, _, env, work = venv
  text = (ROOT / "README.md").read_text()
  section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  (work / "quickstart.py").write_text(re.findall(r"```python\n(.*?)```", section, re.S)[0])
  out = _run([str(python), "quickstart.py"], work, env)
  counted = int(out.splitlines()[0].split()[1])
  total = re.findall(r"^total\s+([\d,]+)\s*$", out, re.M)[-1]
  assert counted == int(total.replace(",", "")) > 0, out  # counted == read from the HLO


def test_experiment_programs_run_from_the_wheel(venv, installed):
  """train.py finds its default config file and the method modules inside the wheel."""
  del installed
  python, _, env, work = venv
  _run([str(python), "-m", "experiments.train", "--config.steps=3", "--config.log_every=1",
        "--config.model.name=mlp", "--config.data.name=digits", "--workdir=runs/t"],
       work, env)
  rows = [json.loads(line) for line in (work / "runs/t/metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows][-1] == 3 and rows[-1]["wire_bytes"] > 0, rows
  assert json.loads((work / "runs/t/config.json").read_text())["method"]["name"] == "dp"
  # absl ends --help with status 1, after the flags of the program (a failed import ends
  # before printing any).
  out = _run([str(python), "-m", "experiments.plan", "--help"], work, env, returncode=1)
  assert "--model" in out and "--mesh" in out and "Try --helpfull" in out, out[-2000:]

