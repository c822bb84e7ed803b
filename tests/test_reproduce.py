"""experiments/reproduce/*.py at tiny settings, in-process: tables, JSON, figures, byte laws;
their command lines (experiments/configs/reproduce/*.py with --config.<path> overrides)."""

import json
import math
import os

import jax
import matplotlib.image
import numpy as np
import pytest

from experiments.reproduce import _reproduce as rep
from experiments import build
from experiments import compression_table
from experiments.reproduce import demo as reproduce_demo
from experiments.reproduce import diloco as reproduce_diloco
from experiments.reproduce import powersgd as reproduce_powersgd
from experiments.reproduce import streaming as reproduce_streaming
from experiments.reproduce import topk as reproduce_topk

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` skips it

STEPS = 8


def tiny(program: str, **settings):
  """experiments/configs/reproduce/<program>.py at one scale for every test (the DP and DiLoCo runs
  the reproductions share train once), with the program's own `settings`."""
  c = rep.load(program)
  c.steps = STEPS
  c.data.update(batch_size=16, seq_len=16)
  c.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32, hidden=(16,))
  c.reproduce.update(eval_batch=8, smooth=2, warm_start_batch=16, **settings)
  rep.check(c)
  return c


def _params(model: str):
  program = "diloco" if model == "lm" else "topk"
  return build.model_task(rep.config(tiny(program), "dp"))[3]


def _num_params(model: str) -> int:
  return sum(x.size for x in jax.tree.leaves(_params(model)))


W = 8


# Byte formulas of docs/algorithms.md written out from the parameters' shapes (the library's
# *_bytes helpers are held against hand literals in the sync tests, not used here).
def _allreduce(nbytes, w=W):
  return 2 * (w - 1) / w * nbytes


def _powersgd_bytes(params, rank, w=W, rate=2):
  """Each matrix n x m (shorter side first, rows = prod(shape[:-1])) with (n + m) r rate < n m
  sends P (n r) in the all-reduce of the exact leaves and Q (m r) in a second one."""
  p = q = exact = 0
  for x in jax.tree.leaves(params):
    if len(x.shape) < 2:
      exact += x.size
      continue
    n, m = sorted((math.prod(x.shape[:-1]), x.shape[-1]))
    r = min(rank, n)
    if (n + m) * r * rate < n * m:
      p, q = p + n * r, q + m * r
    else:
      exact += x.size
  return _allreduce(4 * (p + exact), w) + (_allreduce(4 * q, w) if q else 0.0)


def _demo_bytes(params, chunk=64, k=32):
  """Tiles a x b (largest divisors <= chunk of prod(shape[:-1]) and shape[-1]), min(k, a b)
  (f32 value, index) pairs per tile, indices as wide as the largest tile needs; gathered."""
  divisor = lambda n: max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)
  pairs, tile = 0, 1
  for x in jax.tree.leaves(params):
    rows, cols = (math.prod(x.shape[:-1]), x.shape[-1]) if x.shape else (1, 1)
    a, b = divisor(rows), divisor(cols)
    pairs += (rows // a) * (cols // b) * min(k, a * b)
    tile = max(tile, a * b)
  return (W - 1) * pairs * (4 + (1 if tile <= 256 else 2 if tile <= 2**16 else 4))


def _index_bytes(n):
  return 1 if n <= 256 else 2 if n <= 2**16 else 4


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
    assert len(r["curve"]["loss"]) == STEPS
    for key in ("final_train_loss", "heldout_loss", "bytes_per_step", "peak_bytes_per_step"):
      assert math.isfinite(r[key]), (r["label"], key)
  image = matplotlib.image.imread(os.path.join(workdir, figure))
  assert image.ndim == 3 and image.shape[0] > 100 and image.std() > 0


def test_diloco(tmp_path):
  workdir = str(tmp_path)
  s = reproduce_diloco.run(tiny("diloco", hs=(4,), workers=(1, 8), h_fixed=4,
                                per_worker_batch=2), workdir)
  _check_outputs(workdir, s, s["by_h"] + s["by_workers"], "diloco.png")
  dp, h4 = s["by_h"]
  # DP sends the all-reduce of every parameter every step; DiLoCo the same once every H.
  assert dp["bytes_per_step"] == dp["dp_bytes_per_step"] == _allreduce(4 * _num_params("lm"))
  assert dp["compiled_step_bytes"] == dp["bytes_per_step"]
  assert h4["bytes_per_step"] == dp["bytes_per_step"] / 4
  assert h4["peak_bytes_per_step"] == dp["bytes_per_step"] == h4["compiled_branch_bytes"]
  assert h4["compiled_step_bytes"] == 0  # nothing travels outside the sync branch
  assert np.count_nonzero(h4["curve"]["wire_bytes"]) == STEPS // 4
  one = [r for r in s["by_workers"] if r["workers"] == 1]
  assert len(one) == 2 and all(r["bytes_per_step"] == 0 for r in one)  # nobody to talk to
  # The worker sweep at 8 workers, 2 per worker, H=4 is the H sweep's run, not repeated.
  assert s["by_workers"][-2:] == [h4, dp]


def test_diloco_from_a_dp_warm_start(tmp_path):
  """The DiLoCo paper's protocol: every run starts from the same DP-pretrained parameters and
  continues on the batches after the pretraining's, so every run's first loss is the
  pretrained parameters' loss on batch number `warm` (computed here on one device)."""
  warm = 4
  base = tiny("diloco", hs=(4,), workers=(8,), h_fixed=4, per_worker_batch=2,
              warm_start_steps=warm)
  s = reproduce_diloco.run(base, str(tmp_path))
  dp, h4 = s["by_h"]
  start, params, steps = rep.warm_start(rep.config(base, "dp"))
  assert steps == warm and start["steps"] == warm and start["method"]["name"] == "dp"
  assert dp["warm_start_steps"] == h4["warm_start_steps"] == warm
  _, loss_fn, _, _, batches = build.model_task(rep.config(base, "dp"))
  first = float(loss_fn(params, batches(warm)))
  assert dp["curve"]["loss"][0] == h4["curve"]["loss"][0] == pytest.approx(first, rel=1e-5)
  cold = reproduce_diloco._dp(tiny("diloco"), 8, 16)
  assert cold["curve"]["loss"][0] != pytest.approx(first, rel=1e-3)
  assert f"| {start['label']} |" in s["markdown"] and f"warm start of {warm}" in s["markdown"]


def test_powersgd(tmp_path):
  workdir = str(tmp_path)
  # table=True: ResNet-18's compression table, whose rows are checked counted == compiled.
  # 4 workers: the same laws at half the devices' memory and threads.
  w = 4
  s = reproduce_powersgd.run(tiny("powersgd", ranks=(1,), table=True), workdir,
                             workers=w)
  _check_outputs(workdir, s, s["runs"], "powersgd.png")
  params = _params("mlp")
  dp, *lowrank = s["runs"]
  assert [(r["rank"], r["error_feedback"]) for r in lowrank] == \
      [(1, True), (1, False)]
  for r in lowrank:  # error feedback changes what is sent, not how much
    assert r["bytes_per_step"] == r["compiled_step_bytes"] == \
        _powersgd_bytes(params, r["rank"], w)
    assert 0 <= r["heldout_accuracy"] <= 1
  assert dp["bytes_per_step"] == dp["dp_bytes_per_step"] == dp["compiled_step_bytes"]
  # ResNet-18 (11,173,962 parameters): the table's bytes (counted, checked against the
  # compiled program inside run()) against the formula on its shapes.
  resnet = compression_table.model_params("resnet18")
  (_, size, dp_bytes, _, _), (name, _, rank1, _, ratio) = s["compression"]
  assert size == 11_173_962 and dp_bytes == _allreduce(4 * size, w)
  assert name == "PowerSGD rank 1" and rank1 == _powersgd_bytes(resnet, 1, w)
  assert ratio == dp_bytes / rank1 > 100


def test_topk(tmp_path):
  workdir = str(tmp_path)
  s = reproduce_topk.run(tiny("topk", fractions=(0.1,)), workdir)
  _check_outputs(workdir, s, s["runs"], "topk.png")
  dp, with_memory, without = s["runs"]
  n = _num_params("mlp")
  k = max(1, round(0.1 * n))  # (f32 value, index) pairs of the top 10 %, all-gathered
  sent = (W - 1) * k * (4 + _index_bytes(n))
  assert with_memory["bytes_per_step"] == without["bytes_per_step"] == sent
  assert with_memory["compiled_step_bytes"] == sent
  assert sent < dp["bytes_per_step"]


def test_demo(tmp_path):
  workdir = str(tmp_path)
  s = reproduce_demo.run(tiny("demo", ks=(32,)), workdir)  # one DeMo run: cheap
  _check_outputs(workdir, s, s["runs"], "demo.png")
  dp, k32 = s["runs"]
  params = _params("lm")
  assert k32["bytes_per_step"] == k32["compiled_step_bytes"] == _demo_bytes(params, 64, 32)
  assert k32["bytes_per_step"] < dp["bytes_per_step"]


def test_streaming(tmp_path):
  workdir = str(tmp_path)
  h, p = 4, 2
  s = reproduce_streaming.run(tiny("streaming", h=h, fragments=p, overlap=1),
                              workdir)
  _check_outputs(workdir, s, s["runs"], "streaming.png")
  dp, diloco, exact, paper = s["runs"]
  n = _num_params("lm")
  assert diloco["peak_bytes_per_step"] == dp["bytes_per_step"]
  # Each f32 fragment is ceil(n / P) elements: the peak is DiLoCo's / P up to that padding.
  m = math.ceil(n / p)
  assert exact["peak_bytes_per_step"] == _allreduce(4 * m) == exact["compiled_branch_bytes"]
  assert exact["peak_bytes_per_step"] * p == pytest.approx(diloco["peak_bytes_per_step"],
                                                           abs=_allreduce(4 * p))
  # Same total: P fragment syncs per H steps against one full sync.
  assert exact["total_bytes"] == pytest.approx(diloco["total_bytes"],
                                               abs=STEPS * _allreduce(4))
  # fp4 codes (4 bits each, an f32 scale per 32) are not summable: they are all-gathered.
  assert paper["peak_bytes_per_step"] == (W - 1) * (math.ceil(m / 2) + 4 * math.ceil(m / 32))
  assert np.count_nonzero(exact["curve"]["wire_bytes"]) == p * STEPS // h


def test_a_setting_out_of_range_is_refused():
  for section, name, value in (("", "steps", 0), ("reproduce", "smooth", 0),
                               ("reproduce", "warm_start_steps", -1)):
    c = tiny("diloco")
    (c[section] if section else c)[name] = value
    with pytest.raises(ValueError, match=f"config.{section}{'.' * bool(section)}{name} must"):
      rep.check(c)
