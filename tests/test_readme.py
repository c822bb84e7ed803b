"""The README's sections run as written (extracted, and run in this process or in a fresh
interpreter). The Quickstart runs, in a fresh interpreter, from the built wheel
(tests/test_wheel.py), which asserts what running it from the checkout would."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` skips it

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _first_block(heading):
  text = (ROOT / "README.md").read_text()
  section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert blocks, f"README has no ```python block under '## {heading}'"
  return blocks[0]


def _own_section_blocks():
  text = (ROOT / "README.md").read_text()
  section = text.split("## Your own codec, transform or model", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 6, "codec, training, transform, error memory, local gradient, model"
  return blocks


def test_readme_own_codec_transform_and_model_run_and_count_exact_bytes(capsys):
  """Runs the section's blocks in order, in this process (8 devices), checking each."""
  import jax
  import optax
  from jaxcomm import comm
  codec_block, train_block, transform_block, memory_block, local_block, model_block = \
      _own_section_blocks()
  ns = {"__name__": "readme_own"}
  exec(codec_block, ns)
  exec(train_block, ns)
  # Per step each worker all-gathers its (bf16 value, uint8 column) pairs: 2 per row of
  # Dense_0's kernel (64 rows), Dense_1's (16 rows) and each bias (1 row): 164 pairs of 3
  # bytes from each of the 7 other workers = 3444 bytes.
  trainer, state, batch, m = ns["trainer"], ns["state"], ns["batch"], ns["m"]
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  assert int(m["wire_bytes"]) == round(report.wire_bytes()) == 7 * 164 * 3
  assert float(m["loss"]) < 2.1 < float(jax.numpy.log(10.0))  # it learns (chance: ln 10)
  exec(transform_block, ns)
  assert int(ns["vote_m"]["wire_bytes"]) == round(ns["report"].wire_bytes()) == 7 * 2
  exec(memory_block, ns)  # it runs the transform contract on one device
  assert isinstance(ns["half_ef"], ns["sync"].ErrorMemory)
  before = ns["params"]
  exec(local_block, ns)
  # Three data-parallel steps of SGD with momentum equal three full-batch steps on one device
  # (each batch is 64 rows; each worker's mean loss over 8 rows, averaged over 8 workers, is
  # the mean), momentum carried across the steps as the block carries its optimiser state.
  ref_tx, want = optax.sgd(0.1, momentum=0.9), before
  ref_state = ref_tx.init(want)
  for t in range(3):
    full = jax.grad(ns["loss"])(want, ns["digits"].batch(t, 64))
    updates, ref_state = ref_tx.update(full, ref_state, want)
    want = optax.apply_updates(want, updates)
  for a, b in zip(jax.tree.leaves(ns["params"]), jax.tree.leaves(want)):
    assert float(jax.numpy.max(jax.numpy.abs(a - b))) < 1e-5
  exec(model_block, ns)
  # The NNX net: Linear(64, 32) and Linear(32, 10): 2 pairs per row of 64 + 32 kernel rows
  # and of each bias = 196 pairs of 3 bytes, from 7 other workers.
  assert int(ns["nnx_m"]["wire_bytes"]) == 7 * 196 * 3
  assert "total" in capsys.readouterr().out  # the inspect table was printed


def test_readme_own_schedule_runs_and_counts_exact_bytes(capsys):
  """The schedule written on `local.periodic`: bytes counted == inspected == by hand."""
  import jax
  import numpy as np
  from jaxcomm import comm
  ns = {"__name__": "readme_schedule"}
  exec(_first_block("Your own local-update schedule"), ns)
  trainer, state, batch = ns["trainer"], ns["state"], ns["batch"]
  # Dense_0 (64 x 16 kernel + 16 bias = 1040 float32) all-reduced over 8: 2 * 7/8 * 4160.
  by_hand = 7280
  steps = [line.split() for line in capsys.readouterr().out.splitlines()[:4]]
  assert [int(s[-1]) for s in steps] == [0, by_hand, 0, by_hand]
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  assert report.wire_bytes(conditional=True) == by_hand
  assert report.wire_bytes(conditional=False) == 0
  layers = state.params["params"]
  spread = lambda tree: max(float(np.ptp(np.asarray(x), axis=0).max())
                            for x in jax.tree.leaves(tree))
  # Shared (equal up to the rounding of p + (mean - p)); per worker.
  assert spread(layers["Dense_0"]) < 1e-6 < 1e-3 < spread(layers["Dense_1"])


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
