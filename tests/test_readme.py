"""The README's Quickstart runs as written (extracted and run in a fresh interpreter)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _first_block(heading):
  text = (ROOT / "README.md").read_text()
  section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert blocks, f"README has no ```python block under '## {heading}'"
  return blocks[0]


def _quickstart():
  return _first_block("Quickstart")


def test_readme_quickstart_runs(tmp_path):
  script = tmp_path / "quickstart.py"
  script.write_text(_quickstart())
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  assert proc.returncode == 0, f"README quickstart failed:\n{proc.stdout}\n{proc.stderr}"
  # It prints the loss and the counted bytes, then the inspect table with its total.
  assert "total" in proc.stdout, proc.stdout


def test_readme_own_model_runs(tmp_path):
  """The NNX model on a folder of text files with DiLoCo: it trains and writes TensorBoard."""
  script = tmp_path / "own.py"
  script.write_text(_first_block("Your own model, data and dashboard"))
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, f"README section failed:\n{proc.stdout}\n{proc.stderr}"
  workdir = tmp_path / "runs" / "own"
  assert len((workdir / "metrics.jsonl").read_text().splitlines()) == 4
  assert list(workdir.glob("events.out.tfevents.*"))
