"""experiments/compare.py: equal time budgets per link read off one training run per method,
the exact accounting of time to target and steps in budget, the one monotone clock, links
of one's own, a method plugin from a folder outside the repository, and the properties of
the figures (counted bytes against the compiled step, compression ratios, overlap, bf16).

One tiny end-to-end run (module-scoped) serves every test that needs a run."""

import copy
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import matplotlib.image
import nbformat
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P

from experiments import _compare_report as report
from experiments import build
from experiments import compare
from experiments import config as _config
from experiments.configs import compare as compare_config
from jaxcomm import codecs
from jaxcomm import comm
from jaxcomm import sim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = compare_config.get_config()
TINY.steps = 6
TINY.data.update(batch_size=16, seq_len=16)
TINY.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
TINY.compare.update(smooth=2, compute_repeats=2, max_steps=12)
W = 8
H = 3  # TINY's local-update period
TINY_METHODS = {
    **{label: compare.METHODS[label] for label in ("dp", "dp_bf16", "topk1%_ef", "acco")},
    # Streaming DiLoCo as compare.METHODS has it, with a period short enough for TINY.
    "streaming": {**compare.METHODS["streaming_h10"], "sync_every": H, "overlap": 1},
}


def _readme_plugin() -> str:
  """The README's method of one's own (under "`make run`"), as a user would save it."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  section = text.split("## `make run`", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, re.S)[0]


def _repository_files() -> set:
  """The repository's files, tracked or not (ignored ones aside): a plugin adds none."""
  return set(subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True
                            ).stdout.splitlines())


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
  path = tmp_path_factory.mktemp("plugin") / "my_method.py"
  path.write_text(_readme_plugin())
  return str(path)


@pytest.fixture(scope="module")
def summary(tmp_path_factory, plugin):
  """The tiny comparison (with the plugin), counting the runs it builds."""
  workdir = str(tmp_path_factory.mktemp("compare"))
  built = []
  real_build = build.build

  def counting_build(config, *args, **kwargs):
    built.append(config.method.name)
    return real_build(config, *args, **kwargs)

  before = _repository_files()
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(build, "build", counting_build)
    result = compare.run(TINY, workdir, list(TINY_METHODS) + [plugin], verbose=True,
                         catalog=TINY_METHODS)
  assert _repository_files() == before  # the plugin added no file to the repository
  return workdir, result, built


def _by_method(result):
  return {m["method"]: m for m in result["methods"]}


# ---------------------------------------------------------------- the accounting, exactly
def test_accounting_on_a_synthetic_curve_and_clock():
  smoothed = [5.0, 4.0, 3.0, 2.6, 2.5, 2.0, 1.0]
  known = [1.0, 2.0, 3.0, 3.0, 4.0, 5.5, 7.0]  # a plateau: two steps known at once
  # The steps a link allows are the most whose clock fits the budget; the time to target is
  # the clock at the first step whose smoothed loss is at or below it.
  a = compare.account(smoothed, known, target=2.5, budget=4.0, max_steps=7)
  assert a == {"steps": 5, "seconds": 4.0, "time_to_target": 4.0, "steps_to_target": 5,
               "stopped": "reached"}
  assert sim.time_to_target(smoothed[:5], known[:5], 2.55) == 4.0
  # The budget ends inside the plateau's end: both steps known at 3.0 fit, the next not.
  a = compare.account(smoothed, known, target=2.5, budget=3.9, max_steps=7)
  assert a == {"steps": 4, "seconds": 3.0, "time_to_target": None, "steps_to_target": None,
               "stopped": "budget spent"}
  # A budget exactly at a step's clock includes that step.
  assert compare.account(smoothed, known, 0.5, budget=5.5, max_steps=7)["steps"] == 6
  # Every step trained fits (the step cap stopped the run): labelled so, not as a failure.
  a = compare.account(smoothed, known, target=0.5, budget=100.0, max_steps=7)
  assert (a["steps"], a["seconds"], a["stopped"]) == (7, 7.0, "step cap")
  # Reaching the target is reported even at the cap.
  assert compare.account(smoothed, known, 1.0, 100.0, 7)["stopped"] == "reached"
  # Not even the first step fits.
  assert compare.account(smoothed, known, 2.5, 0.5, 7)["steps"] == 0
  with pytest.raises(ValueError, match="non-decreasing"):
    compare.account(smoothed, known[::-1], 2.5, 4.0, 7)


def test_steps_within_and_time_to_target_refuse_a_clock_that_runs_backwards():
  assert sim.steps_within([0.5, 1.0, 1.0, 2.0], 1.0) == 3
  assert sim.steps_within([], 1.0) == 0
  with pytest.raises(ValueError, match="Timeline.known"):
    sim.time_to_target([3.0, 2.0], [2.0, 1.0], 2.5)
  with pytest.raises(ValueError, match="budget"):
    sim.steps_within([1.0], -1.0)


# ---------------------------------------------------------------- the one clock
@settings(max_examples=60, deadline=None)
@given(compute=st.lists(st.floats(0.001, 1.0), min_size=1, max_size=30),
       comm_s=st.lists(st.sampled_from([0.0, 0.05, 0.3, 2.0]), min_size=30, max_size=30),
       overlap=st.integers(0, 4))
def test_the_clock_is_monotone_for_every_schedule(compute, comm_s, overlap):
  t = sim.simulate(compute, comm_s[:len(compute)], overlap_steps=overlap)
  assert np.all(np.diff(t.known) >= 0)
  assert np.all(t.known >= t.done) and t.known[-1] == t.total == t.done.max()
  np.testing.assert_array_equal(t.known, np.maximum.accumulate(t.done))


def test_with_overlap_a_step_can_end_before_an_earlier_sync():
  """Why `known`: Streaming DiLoCo's sync step ends after the next steps' compute."""
  t = sim.simulate(0.1, [0.0, 0.0, 0.5, 0.0, 0.0, 0.0], overlap_steps=2)
  assert np.any(np.diff(t.done) < 0)
  np.testing.assert_allclose(t.known, [0.1, 0.2, 0.8, 0.8, 0.8, 0.9])


def test_compare_and_notebook_03_read_the_same_clock(summary):
  """Every record's time axis is `sim.simulate(...).known` of its own compute and
  communication (recomputed here), monotone for the overlapping schedules, and notebook 03
  plots and prints that clock (`timeline.known`, `timeline.total`), never a step's own end."""
  _, result, _ = summary
  for m in result["methods"]:
    for net in m["links"].values():
      timeline = sim.simulate(m["compute_seconds_per_step"], net["comm_seconds"],
                              overlap_steps=m["overlap_steps"])
      assert net["time"] == timeline.known.tolist()
      assert np.all(np.diff(net["time"]) >= 0)
  assert {m["overlap_steps"] for m in result["methods"] if m["algo"] in
          ("streaming_diloco", "acco")} == {1}
  nb = nbformat.read(os.path.join(ROOT, "colab", "03_local_updates.ipynb"), as_version=4)
  code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
  assert "timeline.known" in code and "timeline.total" in code
  assert ".done" not in code


# ---------------------------------------------------------------- links
@pytest.mark.parametrize("spec, gbit, latency", [
    ("office:gbit=0.5,latency_ms=40", 0.5, 0.04),
    (" lab-2:latency_ms=0.005, gbit=100 ", 100.0, 5e-6),
    ("wan", 1.0, 0.03),
    ("internet", 0.1, 0.04),
])
def test_link_specs(spec, gbit, latency):
  link = _config.parse_link(spec)
  assert link.bandwidth == pytest.approx(gbit * 1e9 / 8) and link.latency == \
      pytest.approx(latency)
  assert link.name == spec.strip().partition(":")[0]


@pytest.mark.parametrize("spec, words", [
    ("carrier_pigeon", "'carrier_pigeon' is not a preset; allowed: .*wan"),
    (":gbit=1,latency_ms=1", "the name before ':'"),
    ("my link:gbit=1,latency_ms=1", "the name before ':'"),
    ("wan:gbit=1,latency_ms=1", "'wan' is a preset's"),
    ("x:gbit", "part 'gbit' must be key=value"),
    ("x:bandwidth=1,latency_ms=1", "unknown key 'bandwidth'; allowed: gbit, latency_ms"),
    ("x:gbit=fast,latency_ms=1", "gbit must be a number, got 'fast'"),
    ("x:gbit=1", "missing latency_ms"),
    ("x:gbit=0,latency_ms=1", "gbit must be a finite number > 0"),
    ("x:gbit=inf,latency_ms=1", "gbit must be a finite number > 0"),
    ("x:gbit=1,latency_ms=-3", "latency_ms must be a finite number >= 0"),
    ("x:gbit=1,gbit=2,latency_ms=1", "gbit is given twice"),
])
def test_bad_link_specs_name_the_wrong_part(spec, words):
  with pytest.raises(ValueError, match=words):
    _config.parse_link(spec)


def test_link_flags_and_bad_settings_fail_before_anything_trains(tmp_path):
  c = compare.with_flags(TINY, ["wan"], ["office:gbit=0.5,latency_ms=40"], budget=2.0,
                         max_steps=20)
  assert list(compare.links(c)) == ["wan", "office"]
  assert (c.compare.budget, c.compare.max_steps) == (2.0, 20)
  assert compare.links(compare.with_flags(TINY, custom=["x:gbit=1,latency_ms=1"])).keys() == \
      {"wan", "internet", "infiniband", "x"}
  for bad, words in ((compare.with_flags(TINY, ["wan", "wan"]), "twice"),
                     (compare.with_flags(TINY, ["nope"]), "'nope' is not a preset"),
                     (compare.with_flags(TINY, budget=0.0), "budget"),
                     (compare.with_flags(TINY, max_steps=3), "max_steps")):
    with pytest.raises(ValueError, match=words):
      compare.run(bad, str(tmp_path), ["dp"], verbose=False, catalog=TINY_METHODS)
  with pytest.raises(ValueError, match="'nope' is unknown; allowed: dp"):
    compare.resolve_methods(["nope"], TINY_METHODS)
  with pytest.raises(ValueError, match="no such file"):
    compare.resolve_methods([str(tmp_path / "missing.py")], TINY_METHODS)
  assert not os.listdir(tmp_path)


# ---------------------------------------------------------------- the end-to-end run
def test_one_training_run_per_method_serves_every_link(summary, plugin):
  _, result, built = summary
  names = [compare.method_config(TINY, e).method.name
           for e in (*TINY_METHODS.values(), {"method": plugin})]
  assert sorted(built) == sorted(names)  # one Run built (and trained) per method
  assert len(result["links"]) == 3
  for m in result["methods"]:
    # One run: its steps are consecutive from the first, and every link reads its clock off
    # that one curve, the most generous link taking all of it.
    n = len(m["curve"]["loss"])
    assert m["curve"]["step"] == list(range(1, n + 1))
    assert n == m["steps"] == max(net["steps"] for net in m["links"].values())
    for net in m["links"].values():
      assert len(net["time"]) == n and net["steps"] <= n
    # It trained past its most generous link's budget (the step that showed it was spent),
    # or up to the step cap.
    assert m["trained_steps"] == TINY.compare.max_steps or m["trained_steps"] > n


def test_each_link_gives_each_method_its_budget(summary):
  _, result, _ = summary
  by = _by_method(result)
  for name, link in result["links"].items():
    dp = by["dp"]["links"][name]
    # The budget is DP's simulated time for its TINY.steps steps (x 1.0): DP gets them all.
    assert link["budget_seconds"] == dp["time"][TINY.steps - 1]
    assert dp["steps"] == TINY.steps
    for m in result["methods"]:
      net = m["links"][name]
      assert net["budget_seconds"] == link["budget_seconds"]
      n = net["steps"]
      assert n == sim.steps_within(net["time"], link["budget_seconds"]) or \
          n == len(net["time"]) == TINY.compare.max_steps
      assert net["seconds"] == (net["time"][n - 1] if n else 0.0) <= link["budget_seconds"]
      expected = compare.account(m["curve"]["smoothed_loss"], net["time"],
                                 result["target_loss"], link["budget_seconds"],
                                 TINY.compare.max_steps)
      assert {k: net[k] for k in expected} == expected


def test_the_clock_of_a_synchronous_method_is_compute_plus_its_all_reduce(summary):
  """DP on each link: every step is the measured compute plus the ring/tree all-reduce of
  its counted bytes, charged through `comm.wire_bytes_time` (not the compiled step's cost)."""
  _, result, _ = summary
  dp = _by_method(result)["dp"]
  for name in result["links"]:
    link = _config.parse_link(name)
    comm_s = comm.wire_bytes_time(dp["wire_bytes_per_step"], link, group_size=W,
                                  algorithm="auto")
    per_step = dp["compute_seconds_per_step"] + comm_s
    np.testing.assert_allclose(dp["links"][name]["time"],
                               per_step * np.arange(1, dp["steps"] + 1), rtol=1e-9)


def test_writes_tables_verdicts_report_figures_and_json(summary, plugin):
  workdir, result, _ = summary
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    saved = json.load(f)
  labels = list(TINY_METHODS) + ["my_method"]
  assert [m["method"] for m in saved["methods"]] == labels
  assert saved["verdicts"] == result["verdicts"] and len(saved["verdicts"]) == 3
  for name, verdict in zip(result["links"], result["verdicts"]):
    assert verdict.startswith(f"{name}: ")
    assert "first" in verdict or "fastest" in verdict or "no method" in verdict
  text = result["text"]
  for name in result["links"]:
    assert f"\n{name} (" in text and "budget" in text
  for label in labels:  # the plugin is in every link's table
    assert text.count(f"\n{label} ") == 3, label
  with open(os.path.join(workdir, "report.md"), encoding="utf-8") as f:
    md = f.read()
  for v in result["verdicts"]:
    assert f"* {v}" in md
  assert "| my_method | " in md and plugin in md  # its row, and its module in the settings
  assert md.count("| method | bytes/step |") == 3 and "![loss_vs_time](loss_vs_time.png)" in md
  for name in ("loss_vs_time.png", "loss_vs_bytes.png"):
    image = matplotlib.image.imread(os.path.join(workdir, name))
    assert image.ndim == 3 and image.shape[0] > 100 and image.std() > 0
  for m in saved["methods"]:
    assert set(m["curve"]) == {"step", "loss", "smoothed_loss", "wire_bytes",
                               "cumulative_wire_bytes"}
    assert all(len(v) == m["steps"] for v in m["curve"].values())
    for net in m["links"].values():
      assert {"budget_seconds", "time", "comm_seconds", "steps", "stopped",
              "time_to_target", "speedup"} <= set(net)


def test_verdicts_and_endings_are_read_from_the_records(summary):
  _, result, _ = summary
  methods = copy.deepcopy(result["methods"])
  by = _by_method({"methods": methods})
  a, b = by["dp"]["links"]["wan"], by["acco"]["links"]["wan"]
  a.update(time_to_target=2.0, stopped="reached", steps_to_target=3)
  b.update(time_to_target=0.5, stopped="reached", steps_to_target=2)
  for m in methods:
    if m["method"] not in ("dp", "acco"):
      m["links"]["wan"].update(time_to_target=None, stopped="budget spent")
  by["topk1%_ef"]["links"]["wan"].update(stopped="step cap")
  compare.add_speedups(methods, "dp")
  assert b["speedup"] == 4.0 and a["speedup"] == 1.0
  line = report.verdict(methods, "wan", "dp", 2.5, 12)
  assert line.startswith("wan: acco reaches loss 2.5000 first, in 500.0 ms: 4.00x sooner "
                         "than dp (2.0 s).")
  assert "step cap (12) with budget left: topk1%_ef" in line
  b.update(time_to_target=None, stopped="budget spent")
  assert report.verdict(methods, "wan", "dp", 2.5, 12).startswith(
      "wan: dp is fastest to loss 2.5000, in 2.0 s.")
  rows = {r[0]: r for r in report.rows(methods, "wan")}
  assert rows["acco"][-1] == "budget spent" and rows["dp"][-1] == "reached at step 3"
  assert rows["topk1%_ef"][-1] == "step cap" and rows["topk1%_ef"][5] == "not reached"


# ---------------------------------------------------------------- the plugin
def test_a_plugin_in_a_tmp_folder_is_in_the_table_with_its_overlap(summary, plugin):
  _, result, _ = summary
  mine = _by_method(result)["my_method"]
  assert mine["algo"] == plugin and mine["settings"]["clip"] == 1.0
  assert mine["overlap_steps"] == 1  # its module's overlap_steps, on the clock
  wan = mine["links"]["wan"]
  serial = sim.simulate(mine["compute_seconds_per_step"], wan["comm_seconds"])
  assert wan["time"][-1] < serial.total  # the overlap hides communication there
  # Its bytes: the one-step delayed all-reduce, as exact DP's.
  assert mine["wire_bytes_per_step"] == mine["dp_wire_bytes_per_step"]


def test_a_plugin_in_a_tmp_folder_trains_with_train_py(plugin, tmp_path):
  before = _repository_files()
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  tiny = [f"--config.{k}={v}" for k, v in (
      ("steps", 2), ("checkpoint_every", 0), ("log_every", 1), ("data.batch_size", 16),
      ("data.seq_len", 16), ("model.d_model", 16), ("model.num_layers", 1),
      ("model.num_heads", 2), ("model.d_ff", 32), ("method.clip", 0.5))]
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train",
       f"--config=experiments/configs/default.py:{plugin}", *tiny, f"--workdir={tmp_path}"],
      capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / "summary.json", encoding="utf-8") as f:
    saved = json.load(f)
  assert saved["method"] == plugin and saved["steps"] == 2
  with open(tmp_path / "config.json", encoding="utf-8") as f:
    assert json.load(f)["method"] == {"name": plugin, "clip": 0.5}
  assert saved["wire_bytes_per_step"] == saved["dp_wire_bytes_per_step"]
  assert _repository_files() == before


# ---------------------------------------------------------------- the figures' properties
def test_numbers_come_from_the_run(summary):
  _, result, _ = summary
  by = _by_method(result)
  dp, bf16 = by["dp"], by["dp_bf16"]
  # DP's counted bytes: the ring all-reduce of every parameter, as compiled.
  assert dp["wire_bytes_per_step"] == dp["dp_wire_bytes_per_step"] == \
      dp["inspected_wire_bytes"]["every_step"]
  assert dp["compression_ratio"] == 1.0
  assert bf16["wire_bytes_per_step"] == bf16["inspected_wire_bytes"]["every_step"]
  assert 1.9 < bf16["compression_ratio"] <= 2.0  # bf16 halves it (plus padding to W chunks)
  for m in (dp, bf16):
    assert np.all(np.isfinite(m["curve"]["loss"]))
    assert m["final_loss"] == pytest.approx(
        np.mean(m["curve"]["loss"][m["steps"] - TINY.compare.smooth:m["steps"]]))
  # The target is DP's own smoothed loss at 80 % of its steps, so DP reaches it there.
  assert result["target_loss"] == dp["curve"]["smoothed_loss"][4]
  for net in dp["links"].values():
    assert net["stopped"] == "reached" and net["steps_to_target"] <= 5
  # The WAN is slower than InfiniBand for the same run.
  assert result["links"]["wan"]["budget_seconds"] > result["links"]["infiniband"][
      "budget_seconds"]


def test_counted_bytes_are_the_compiled_steps(summary):
  """Bytes counted in state per step == the compiled step's collectives (comm.inspect):
  every step for synchronous and overlapped methods; for Streaming DiLoCo the compiled sync
  branch sends one fragment (chosen by the step), and each of its P fragments syncs once
  every H steps, so a step sends P/H of that branch on average (over whole periods)."""
  _, result, _ = summary
  for m in result["methods"]:
    every, cond = (m["inspected_wire_bytes"]["every_step"],
                   m["inspected_wire_bytes"]["conditional"])
    if m["algo"] == "streaming_diloco":
      assert every == 0 and cond > 0
      fragments = TINY_METHODS["streaming"]["fragments"]
      periods = m["steps"] // H * H
      # Counters round each sync's bytes to whole bytes.
      assert np.mean(m["curve"]["wire_bytes"][:periods]) == pytest.approx(
          fragments * cond / H, abs=1.0)
    else:
      assert cond == 0
      assert m["wire_bytes_per_step"] == pytest.approx(every, abs=1.0), m["method"]


def test_compression_ratio_is_dp_bytes_over_counted_bytes(summary):
  _, result, _ = summary
  by = _by_method(result)
  dp_bytes = by["dp"]["wire_bytes_per_step"]
  for m in result["methods"]:
    assert m["dp_wire_bytes_per_step"] == dp_bytes
    assert m["compression_ratio"] == pytest.approx(dp_bytes / m["wire_bytes_per_step"])
  # Top-k 1 %: the (value, index) pairs of 1 % of the n entries all-gathered from W - 1
  # peers (docs/algorithms.md), where DP sends 2(W-1)/W * 4n bytes.
  n = round(dp_bytes / (2 * (W - 1) / W * 4))
  topk = by["topk1%_ef"]
  k, index_bytes = max(1, round(0.01 * n)), 1 if n <= 256 else 2 if n <= 2**16 else 4
  assert topk["wire_bytes_per_step"] == (W - 1) * k * (4 + index_bytes)  # f32 value, index
  assert topk["compression_ratio"] > 10
  # ACCO: reduce-scatter + all-gather (= one all-reduce of the padded parameters) + counts.
  assert 0.95 < by["acco"]["compression_ratio"] < 1.0


def test_overlap_is_on_the_simulated_clock(summary):
  _, result, _ = summary
  by = _by_method(result)
  for m in result["methods"]:
    for net in m["links"].values():
      if m["overlap_steps"]:
        assert net["seconds"] <= net["seconds_without_overlap"] + 1e-12
      else:
        assert net["seconds"] == pytest.approx(net["seconds_without_overlap"])
  # On the WAN ACCO's all-reduce takes longer than a step's compute: hiding the compute of
  # the next round behind it shortens the run.
  wan = by["acco"]["links"]["wan"]
  assert wan["seconds"] < wan["seconds_without_overlap"]


def test_dp_bf16_changes_the_updates_but_little(summary):
  _, result, _ = summary
  by = _by_method(result)
  n = min(by["dp"]["steps"], by["dp_bf16"]["steps"])
  dp, bf16 = (np.array(by[k]["curve"]["loss"][:n]) for k in ("dp", "dp_bf16"))
  assert n >= 2 and dp[0] == bf16[0]  # the same parameters and batch before any update
  assert not np.array_equal(dp, bf16)
  np.testing.assert_allclose(dp, bf16, rtol=1e-2)


def test_dp_bf16_builder_reduces_in_bfloat16(mesh8):
  """compare's dp_bf16 Config reaches the builder and the mean really travels in bfloat16:
  worker w's gradient 1 + (w + 1) 2^-12 rounds to 1 in bfloat16 (spacing 2^-7 at 1), so the
  bf16 mean is exactly 1 where the float32 mean is 1 + 4.5 * 2^-12. The inner optimiser is
  SGD with lr 1 here, so the update is minus the mean."""
  grads = 1.0 + (jnp.arange(W, dtype=jnp.float32)[:, None] + 1) * 2.0 ** -12 * jnp.ones((W, 5))

  def update_of(label):
    cfg = compare.method_config(TINY, compare.METHODS[label])
    cfg.optimizer.update(name="sgd", lr=1.0)
    tx = build.make_optimizer(cfg, build.Context(
        config=cfg, inner=build.inner_optimizer(cfg), axis_name="data", num_workers=W,
        mesh_shape={"data": W}, key=jax.random.key(0)))

    def body(g):  # g: f32[1, 5], this worker's gradient
      return tx.update({"g": g[0]}, tx.init({"g": g[0]}))[0]["g"]

    return jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("data"), out_specs=P()))(grads)

  np.testing.assert_array_equal(update_of("dp_bf16"), -np.ones(5, np.float32))
  np.testing.assert_allclose(update_of("dp"), -(1 + 4.5 * 2.0 ** -12), rtol=1e-7)


def test_the_default_list_has_the_methods_a_user_expects():
  algos = {(e["method"], e.get("dtype"), e.get("codec")) for e in compare.METHODS.values()}
  for expected in (("dp", None, None), ("dp", "bfloat16", None), ("powersgd", None, None),
                   ("compressed", None, "uniform:bits=8,block=256"), ("demo", None, None),
                   ("diloco", None, None), ("streaming_diloco", None, None)):
    assert expected in algos, expected


def test_more_methods_run_only_when_named():
  """DES-LOC, NoLoCo and eager DiLoCo are labels `--methods` may name; `make run` (every
  label of METHODS) does not run them. Each entry's settings build a valid config."""
  assert not set(compare.MORE_METHODS) & set(compare.resolve_methods(None))
  chosen = compare.resolve_methods(["noloco_h10", "des_loc_k10"])
  assert list(chosen) == ["dp", "noloco_h10", "des_loc_k10"]
  base = compare_config.get_config()
  for label, entry in compare.MORE_METHODS.items():
    c = compare.method_config(base, entry)
    assert c.method.name == entry["method"], label
    build.build(c, abstract=True)  # the method's settings are accepted by its factory
