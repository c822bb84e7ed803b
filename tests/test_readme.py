"""The README's Quickstart runs as written (extracted and run in a fresh interpreter)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _quickstart():
  text = (ROOT / "README.md").read_text()
  section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert blocks, "README has no ```python block under '## Quickstart'"
  return blocks[0]


def test_readme_quickstart_runs(tmp_path):
  script = tmp_path / "quickstart.py"
  script.write_text(_quickstart())
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  assert proc.returncode == 0, f"README quickstart failed:\n{proc.stdout}\n{proc.stderr}"
  # It prints the loss and the counted bytes, then the inspect table with its total: the
  # bytes counted in the state equal those read from the compiled program.
  first = proc.stdout.splitlines()[0].split()
  loss, counted = float(first[0]), int(first[1])
  totals = re.findall(r"^total\s+([\d,]+)\s*$", proc.stdout, re.M)
  assert totals, proc.stdout
  assert counted == int(totals[-1].replace(",", "")) > 0, proc.stdout
  assert 0 < loss < 10, proc.stdout  # a byte-level LM starts near ln 256 = 5.5
