"""experiments/reproduce_*.py at tiny settings, in-process: tables, JSON, figures, byte laws."""

import json
import math
import os

import matplotlib.image
import numpy as np
import pytest

from experiments import _reproduce as rep
from experiments import build
from experiments import reproduce_demo
from experiments import reproduce_diloco
from experiments import reproduce_powersgd
from experiments import reproduce_streaming
from experiments import reproduce_topk
from jaxcomm import codecs, comm, sync

# One scale for every test: the DP and DiLoCo runs the reproductions share train once.
TINY = rep.base_config(steps=8, batch_size=16, seq_len=16, d_model=16, num_layers=1,
                       eval_batch=8, smooth=2)
TINY.model.update(num_heads=2, d_ff=32, hidden=(16,))


def _params(model: str):
  return build.model_task(rep.config(TINY, model, "dp"))[3]


def _num_params(model: str) -> int:
  return comm.tree_bytes(_params(model)) // 4


def _check_outputs(workdir, summary, records, figure):
  """results.md holds one table row per record; JSON and figure written; numbers finite."""
  with open(os.path.join(workdir, "results.md"), encoding="utf-8") as f:
    text = f.read()
  assert text.strip() == summary["markdown"].strip()
  rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
  for r in records:
    assert any(f"| {r['label']} |" in row for row in rows), r["label"]
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    assert json.load(f)["markdown"] == summary["markdown"]
  for r in records:
    assert len(r["curve"]["loss"]) == TINY.steps
    for key in ("final_train_loss", "heldout_loss", "bytes_per_step", "peak_bytes_per_step"):
      assert math.isfinite(r[key]), (r["label"], key)
  image = matplotlib.image.imread(os.path.join(workdir, figure))
  assert image.ndim == 3 and image.shape[0] > 100 and image.std() > 0


def test_diloco(tmp_path):
  workdir = str(tmp_path)
  s = reproduce_diloco.run(TINY, workdir, hs=(4,), workers=(1, 8), h_fixed=4,
                           per_worker_batch=2)
  _check_outputs(workdir, s, s["by_h"] + s["by_workers"], "diloco.png")
  dp, h4 = s["by_h"]
  # DP sends the all-reduce of every parameter every step; DiLoCo the same once every H.
  assert dp["bytes_per_step"] == dp["dp_bytes_per_step"] == \
      comm.allreduce_bytes(4 * _num_params("lm"), 8)
  assert h4["bytes_per_step"] == dp["bytes_per_step"] / 4
  assert h4["peak_bytes_per_step"] == dp["bytes_per_step"]
  assert np.count_nonzero(h4["curve"]["wire_bytes"]) == TINY.steps // 4
  one = [r for r in s["by_workers"] if r["workers"] == 1]
  assert len(one) == 2 and all(r["bytes_per_step"] == 0 for r in one)  # nobody to talk to
  # The worker sweep at 8 workers, 2 per worker, H=4 is the H sweep's run, not repeated.
  assert s["by_workers"][-2:] == [h4, dp]


def test_diloco_from_a_dp_warm_start(tmp_path):
  """The DiLoCo paper's protocol: every run starts from the same DP-pretrained parameters and
  continues on the batches after the pretraining's, so every run's first loss is the
  pretrained parameters' loss on batch number `warm` (computed here on one device)."""
  warm = 4
  base = rep.base_config(steps=8, batch_size=16, seq_len=16, d_model=16, num_layers=1,
                         eval_batch=8, smooth=2, warm_start_steps=warm)
  base.model.update(num_heads=2, d_ff=32, hidden=(16,))
  s = reproduce_diloco.run(base, str(tmp_path), hs=(4,), workers=(8,), h_fixed=4,
                           per_worker_batch=2)
  dp, h4 = s["by_h"]
  start, params, steps = rep.warm_start(rep.config(base, "lm", "dp"))
  assert steps == warm and start["steps"] == warm and start["method"]["name"] == "dp"
  assert dp["warm_start_steps"] == h4["warm_start_steps"] == warm
  _, loss_fn, _, _, batches = build.model_task(rep.config(base, "lm", "dp"))
  first = float(loss_fn(params, batches(warm)))
  assert dp["curve"]["loss"][0] == h4["curve"]["loss"][0] == pytest.approx(first, rel=1e-5)
  cold = reproduce_diloco._dp(TINY, 8, 16)  # pylint: disable=protected-access
  assert cold["curve"]["loss"][0] != pytest.approx(first, rel=1e-3)
  assert f"| {start['label']} |" in s["markdown"] and f"warm start of {warm}" in s["markdown"]
  with pytest.raises(ValueError, match="warm_start_steps"):
    rep.base_config(warm_start_steps=-1)


def test_powersgd(tmp_path):
  workdir = str(tmp_path)
  s = reproduce_powersgd.run(TINY, workdir, ranks=(1,), table=False)
  _check_outputs(workdir, s, s["runs"], "powersgd.png")
  params = _params("mlp")
  dp, *lowrank = s["runs"]
  assert [(r["rank"], r["error_feedback"]) for r in lowrank] == \
      [(1, True), (1, False)]
  for r in lowrank:  # error feedback changes what is sent, not how much
    assert r["bytes_per_step"] == sync.powersgd_bytes(params, r["rank"], 8)
    assert 0 <= r["heldout_accuracy"] <= 1
  assert dp["bytes_per_step"] == dp["dp_bytes_per_step"]


def test_topk(tmp_path):
  workdir = str(tmp_path)
  s = reproduce_topk.run(TINY, workdir, fractions=(0.1,))
  _check_outputs(workdir, s, s["runs"], "topk.png")
  dp, with_memory, without = s["runs"]
  n = _num_params("mlp")
  sent = comm.compressed_bytes(codecs.top_k(0.1), n, 8, "gather")
  assert with_memory["bytes_per_step"] == without["bytes_per_step"] == sent
  assert sent < dp["bytes_per_step"]


def test_demo(tmp_path):
  workdir = str(tmp_path)
  s = reproduce_demo.run(TINY, workdir, ks=(32,))  # one DeMo run keeps the test cheap
  _check_outputs(workdir, s, s["runs"], "demo.png")
  dp, k32 = s["runs"]
  params = _params("lm")
  assert k32["bytes_per_step"] == sync.demo_bytes(params, 8, 64, 32) < dp["bytes_per_step"]


def test_streaming(tmp_path):
  workdir = str(tmp_path)
  h, p = 4, 2
  scale = TINY
  s = reproduce_streaming.run(scale, workdir, h=h, fragments=p, overlap=1)
  _check_outputs(workdir, s, s["runs"], "streaming.png")
  dp, diloco, exact, paper = s["runs"]
  n = _num_params("lm")
  assert diloco["peak_bytes_per_step"] == dp["bytes_per_step"]
  # Each f32 fragment is ceil(n / P) elements: the peak is DiLoCo's / P up to that padding.
  assert exact["peak_bytes_per_step"] == comm.allreduce_bytes(4 * math.ceil(n / p), 8)
  assert exact["peak_bytes_per_step"] * p == pytest.approx(diloco["peak_bytes_per_step"],
                                                           abs=comm.allreduce_bytes(4 * p, 8))
  # Same total: P fragment syncs per H steps against one full sync.
  assert exact["total_bytes"] == pytest.approx(diloco["total_bytes"],
                                               abs=scale.steps * comm.allreduce_bytes(4, 8))
  # fp4 codes (with block scales) are not summable: they are all-gathered.
  assert paper["peak_bytes_per_step"] == comm.compressed_bytes(codecs.fp4(), math.ceil(n / p),
                                                               8, "gather")
  assert np.count_nonzero(exact["curve"]["wire_bytes"]) == p * scale.steps // h


def test_bad_base_config():
  with pytest.raises(ValueError, match="steps"):
    rep.base_config(steps=0)
  with pytest.raises(ValueError, match="smooth"):
    rep.base_config(smooth=0)
