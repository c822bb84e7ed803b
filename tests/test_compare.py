"""experiments/compare/ as a benchmark protocol: the accounting over seeds (medians with
misses as infinity, paired intervals computed by hand, verdicts only when the interval
excludes 1), the held-out target, the tuned ruleset's per-study choice, one compute figure
per local step, the overlapped clock, links of one's own, a method plugin from a folder
outside the repository, and the figures' properties (counted bytes against the compiled
step, ratios against exact DP's compiled step).

One tiny end-to-end run (module-scoped: 5 methods, 2 seeds, 6 reference steps) serves every
test that needs a run; everything else is synthetic."""

import copy
import json
import math
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import matplotlib.image
import nbformat
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P

from experiments.compare import account as compare_account
from experiments.compare import settings as compare_settings
from experiments.compare import summary as compare_summary
from experiments.compare import trials as compare_trials
from experiments.compare import report as report
from experiments.compare import stats as stats
from experiments import build
from experiments import compare
from experiments import specs
from experiments.configs import compare as compare_config
from jaxcomm import comm
from jaxcomm import sim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = compare_config.get_config()
TINY.steps = 6
TINY.data.update(batch_size=16, seq_len=16)
TINY.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
TINY.compare.update(smooth=2, compute_repeats=2, max_steps=12, seeds=2, eval_every=2,
                    eval_batch=8, scale="proxy")  # the proxy's clock: test_compare_scale.py
W = 8
H = 3  # TINY's local-update period
TINY_METHODS = {
    **{label: compare.METHODS[label] for label in ("dp_bf16", "dp", "topk1%_ef")},
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
    built.append((config.method.name, config.seed))
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
def test_accounting_of_a_trial_on_a_synthetic_clock():
  known = [1.0, 2.0, 3.0, 3.0, 4.0, 5.5, 7.0]  # a plateau: two steps known at once
  steps, heldout = [2, 4, 6], [3.0, 2.5, 2.0]  # evaluated every 2 steps
  # The steps a link allows are the most whose clock fits the budget; the steps to the target
  # are interpolated between the readings around it, the time is the clock there.
  a = compare_account.account(steps, heldout, known, target=2.5, budget=4.0, max_steps=7)
  assert a == {"steps": 5, "seconds": 4.0, "time_to_target": 3.0, "steps_to_target": 4,
               "stopped": "reached"}
  # An evaluation beyond the budget does not count.
  a = compare_account.account(steps, heldout, known, target=2.0, budget=5.0, max_steps=7)
  assert a == {"steps": 5, "seconds": 4.0, "time_to_target": None, "steps_to_target": None,
               "stopped": "budget spent"}
  assert compare_account.account(steps, heldout, known, 2.0, 5.5, 7)["time_to_target"] == 5.5
  # Every step trained fits (the step cap stopped the trial): labelled so.
  a = compare_account.account(steps, heldout, known, target=1.0, budget=100.0, max_steps=7)
  assert (a["steps"], a["seconds"], a["stopped"]) == (7, 7.0, "step cap")
  assert compare_account.account(steps, heldout, known, 2.5, 0.5, 7)["steps"] == 0
  # Between readings: 2.75 is halfway from 3.0 (step 2) to 2.5 (step 4): step 3, 3.0 s;
  # 2.25 halfway to 2.0 (step 6): step 5, 4.0 s; 2.4 a fifth of the way: step 4.4, whose
  # clock is 3.0 + 0.4 x (4.0 - 3.0).
  for target, at, time in ((2.75, 3.0, 3.0), (2.25, 5.0, 4.0), (2.4, 4.4, 3.4)):
    a = compare_account.account(steps, heldout, known, target, 100.0, 7)
    assert (a["steps_to_target"], a["time_to_target"]) == pytest.approx((at, time))
  # From step 0 (the initial parameters' reading): two methods that reach the target at
  # their first reading are told apart by how far below it they are.
  first = [compare_account.account([0, 2], [4.0, l], known, 3.0, 100.0, 7)["steps_to_target"]
           for l in (2.9, 2.0)]
  assert first == pytest.approx([2 * 1.0 / 1.1, 2 * 0.5])
  # No reading after step 0 in the budget: not evaluated, not a miss.
  assert compare_account.account([0, 6], [4.0, 2.0], known, 2.5, 4.0, 7)["stopped"] == \
      "not evaluated"
  with pytest.raises(ValueError, match="non-decreasing"):
    compare_account.account(steps, heldout, known[::-1], 2.5, 4.0, 7)


def test_evaluations_fall_on_a_grid_of_simulated_time():
  """A link's evaluations are at the first step whose clock reaches each multiple of its
  interval: a step that crosses several multiples is one evaluation, and two methods with
  different step times are read at the same resolution in time (a step grid would not)."""
  known = [0.4, 0.8, 1.2, 2.9, 3.0, 3.1, 3.9, 4.0]
  # multiples 1, 2, 3 and 4 s: first reached at steps 3 (1.2), 4 (2.9), 5 (3.0), 8 (4.0)
  assert compare_account.grid_steps(known, 1.0).tolist() == [3, 4, 5, 8]
  assert compare_account.grid_steps(known, None).tolist() == list(range(1, 9))
  assert compare_account.grid_steps([5.0], 1.0).tolist() == [1]  # 5 multiples, one step
  assert compare_account.on_grid([2, 3, 8], known, 1.0).tolist() == [False, True, True]
  # 0.1 s per step, an interval of 3 steps' time: every 3rd step despite rounding.
  steady = np.cumsum(np.full(30, 0.1))
  assert compare_account.grid_steps(steady, steady[2]).tolist() == list(range(3, 31, 3))
  # A method at 0.05 s per step on the same grid: every 6th step, the same times.
  fast = np.cumsum(np.full(60, 0.05))
  assert fast[compare_account.grid_steps(fast, steady[2]) - 1] == pytest.approx(
      steady[2::3])
  assert compare_account.multiples(0.3 - 1e-12, 0.1) == 3  # rounding does not miss one


class _SyntheticPopulation(compare_trials.Population):
  """`Population.train_to` on synthetic trials: per link a fixed step time (its clock) and
  per trial a noisy falling held-out curve, no model (the skip rule of `aim`, exactly)."""

  STEP = {"a": 0.1, "b": 0.37, "c": 0.05}  # seconds per step on each link

  def __init__(self, curves: np.ndarray, intervals: dict):
    self.curves, self.evaluated = curves, 0
    self.trainers, self.states = [types.SimpleNamespace(trials=len(curves))], [None]
    self.costs = dict.fromkeys(self.STEP)
    self.trials = [self._trial(t) for t in range(len(curves))]
    self.grid, self.target, self.seconds, self.final = None, None, 0.0, None
    self.eval_every = 25
    self.watch, self.watch_step, self.snapshots = {}, 0, {}
    self.evaluate_on(None, intervals)

  def _trial(self, seed: int):
    step_time = self.STEP

    class Trial(compare_trials.Trial):
      def clocks(self, clock):
        n = len(self.history)
        return {k: types.SimpleNamespace(known=np.arange(1, n + 1) * v)
                for k, v in step_time.items()}
    return Trial(self, seed)

  def _batch(self, k, step):
    return step

  def evaluate(self, trainer, state, which=None):
    which = range(len(self.curves)) if which is None else which
    self.evaluated += len(which)
    return [float(self.curves[t, self.trained - 1]) for t in which]


def test_skipped_evaluations_change_no_time_to_the_target(monkeypatch):
  """Once the target is known (`Population.aim`), a trial is evaluated on a link's grid only
  until it has reached the target there: every link's account (time and steps to the
  target, how the run ended), for any budget, is the one of evaluating every grid step."""
  rng = np.random.default_rng(0)
  steps = 120
  curves = 3.0 - np.linspace(0, 1.2, steps) + rng.normal(0, 0.05, (3, steps))
  intervals = {"a": 0.4, "b": 1.1, "c": 0.3}
  trainer = types.SimpleNamespace(trials=3, step=lambda state, step: (
      state, {"loss": np.zeros(3), "wire_bytes": np.zeros(3)}))
  full, skipping = (_SyntheticPopulation(curves, intervals) for _ in range(2))
  for pop in (full, skipping):
    pop.trainers = [trainer]
    pop.train_to(30)
  target = 2.4
  skipping.aim(target)
  for pop in (full, skipping):
    pop.train_to(steps)
  assert skipping.evaluated < full.evaluated * 0.8  # the later evaluations were skipped
  for a, b in zip(full.trials, skipping.trials):
    for link, step_time in _SyntheticPopulation.STEP.items():
      known = np.arange(1, steps + 1) * step_time
      for budget in (2.0, 5.0, known[-1] / 2, known[-1]):
        assert compare_account.account(*b.evals_on(link), known, target, budget, steps) \
            == compare_account.account(*a.evals_on(link), known, target, budget, steps)


def test_each_link_takes_the_faster_of_the_reference_pool():
  """Per link the reference is the pool's label with the lower median time to the target
  (bf16 DP on one link, f32 DP on the other); the budget is its median times `budget`, and
  every speed-up and verdict there is against it."""
  trials = {"bf16": [[_FakeTrial({"a": 10.0, "b": 30.0}), _FakeTrial({"a": 12.0, "b": 36.0}),
                      _FakeTrial({"a": 14.0, "b": 42.0})]],
            "f32": [[_FakeTrial({"a": 11.0, "b": 20.0}), _FakeTrial({"a": 13.0, "b": 24.0}),
                     _FakeTrial({"a": 15.0, "b": 28.0})]],
            "m": [[_FakeTrial({"a": 5.0, "b": 10.0}), _FakeTrial({"a": 6.0, "b": 12.0}),
                   _FakeTrial({"a": 7.0, "b": 14.0})]]}
  config = copy.deepcopy(TINY)
  config.compare.update(reference="bf16", reference_pool=("bf16", "f32"), seeds=3, budget=2.0)
  clock = types.SimpleNamespace(links={"a": None, "b": None})
  budgets, refs = compare_summary.budgets_and_references(trials, clock, 2.5, config)
  assert refs == {"a": "bf16", "b": "f32"} and budgets == {"a": 24.0, "b": 48.0}
  _, out, _ = compare_summary.summarise(trials, clock, 2.5, config)
  assert out["bf16"]["a"]["verdict"] == out["f32"]["b"]["verdict"] == "reference"
  assert out["m"]["a"]["speedup"] == 2.0 and out["m"]["b"]["speedup"] == 2.0  # 12/6, 24/12
  assert out["bf16"]["b"]["verdict"] == "slower" and out["m"]["b"]["reference"] == "f32"
  assert report.verdict(out, "b", "bf16", 2.5).startswith("b: m reaches held-out 2.5000 "
                                                          "first: 2.00x sooner than f32")
  # Not in the pool, or the pool's other labels not run: the reference alone.
  config.compare.reference_pool = ("bf16",)
  assert compare_summary.budgets_and_references(trials, clock, 2.5, config)[1] == {
      "a": "bf16", "b": "bf16"}


def test_median_counts_a_miss_as_infinity():
  assert stats.median_time([3.0, None, 1.0]) == 3.0
  assert stats.median_time([3.0, None, None]) == math.inf  # missed on most seeds
  assert stats.median_time([2.0, 4.0, None, 1.0]) == 3.0
  assert stats.higher_median([1.0, 2.0, 3.0, 4.0]) == 3.0 and stats.higher_median([5.0]) == 5.0


def test_the_interval_of_a_3_seed_case_by_hand():
  """Reference 10, 12, 14 s and the method 4, 5, 8 s on seeds 0, 1, 2: paired speed-ups
  2.5, 2.4 and 1.75, log ratios 0.9163, 0.8755, 0.5596 (mean 0.7838, sd 0.1952); with
  t_2 = 4.3027 the half-width is 4.3027 x 0.1952 / sqrt(3) = 0.4850: 2.19x, 1.35-3.56x."""
  s, lo, hi, how = stats.speedup_interval([10.0, 12.0, 14.0], [4.0, 5.0, 8.0])
  assert (round(s, 3), round(lo, 3), round(hi, 3)) == (2.19, 1.348, 3.556)
  assert "95 % t-interval on the paired log speed-ups over 3 seeds" in how
  assert stats.classify(lo, hi) == "faster"
  # The method misses on seed 1, counted as the budget (20 s): ratios 2.5, 0.6, 1.75: the
  # interval spans 1.
  s, lo, hi, _ = stats.speedup_interval([10.0, 12.0, 14.0], [4.0, None, 8.0], censor=20.0)
  assert lo < 1 < hi and stats.classify(lo, hi) == "not distinguishable"
  assert stats.classify(0.5, 0.9) == "slower"
  # Misses on both sides show no difference (1), never a division by zero.
  assert stats.ratio(math.inf, math.inf) == 1.0 and stats.ratio(math.inf, 2.0) == math.inf


def _summary_of(times: dict, reference: str = "ref") -> dict:
  """A compare_summary.summarise-shaped summary on one link "l" from per-seed times."""
  out = {}
  ref = times[reference]
  for m, t in times.items():
    s, lo, hi, how = stats.speedup_interval(ref, t, censor=30.0)
    out[m] = {"l": {"study_times": t, "median": stats.median_time(t), "speedup": s,
                    "low": lo, "high": hi, "interval": how,
                    "reached": sum(x is not None for x in t),
                    "verdict": "reference" if m == reference else stats.classify(lo, hi)}}
  return out


def test_verdicts_carry_the_interval_and_say_when_nothing_is_distinguishable():
  summary = _summary_of({"ref": [10.0, 12.0, 14.0], "fast": [4.0, 5.0, 8.0],
                         "lucky": [4.0, None, 8.0], "slow": [20.0, 24.0, 28.0]})
  lucky = summary.pop("lucky")
  line = report.verdict(summary, "l", "ref", 2.5, 30.0)
  assert line == ("l: fast reaches held-out 2.5000 first: 2.19x sooner than ref (95 % CI "
                  "1.35-3.56x, 3/3 seeds).")
  # "lucky" misses on seed 1 (counted as the 30 s budget): fast / lucky = 1, 6, 1 per seed,
  # 1.82x with a 95 % interval spanning 1: the two cannot be told apart.
  summary["lucky"] = lucky
  line = report.verdict(summary, "l", "ref", 2.5, 30.0)
  assert line.startswith("l: fast and lucky tie for first (the interval of their ratio "
                         "contains 1): fast reaches held-out 2.5000 2.19x sooner than ref (95 "
                         "% CI 1.35-3.56x, 3/3 seeds), lucky 1.21x (95 % CI 0.11-13.46x; fast "
                         "/ lucky: 1.82x, 95 % CI ")
  del summary["fast"]  # the interval of "lucky" spans 1: no verdict for it
  line = report.verdict(summary, "l", "ref", 2.5, 30.0)
  assert line.startswith("l: no method is distinguishable from ref here (ref reaches "
                         "held-out 2.5000 in 12.0 s, 3/3 seeds; best other: lucky "
                         "1.21x (95 % CI 0.11-13.46x, 2/3 seeds)")
  assert summary["slow"]["l"]["verdict"] == "slower"


class _FakeTrial:
  """What compare_summary.summarise reads of a trial: its held-out evaluations and its accounts."""

  def __init__(self, times: dict, evals=((2, 3.0), (4, 2.0))):
    self.times, self.evals = times, list(evals)
    self.history = [{"loss": 9.0}] * 4

  def accounts(self, clock, budgets, target, cap):
    del clock, budgets, target, cap
    return {n: {"time_to_target": t} for n, t in self.times.items()}


def test_the_tuned_ruleset_picks_per_study_the_fastest_setting_on_every_link():
  # times[setting][study]: per study the minimum over settings, and which setting it was.
  best, chosen = stats.best_per_study([[5.0, None, 3.0], [4.0, 6.0, None], [9.0, 7.0, 2.0]])
  assert best.tolist() == [4.0, 6.0, 2.0] and chosen.tolist() == [1, 1, 2]
  # compare_summary.summarise: the same settings of each method are read on every link; each link
  # picks per study its own fastest.
  trials = {
      "ref": [[_FakeTrial({"a": 10.0, "b": 20.0}), _FakeTrial({"a": 12.0, "b": 24.0}),
               _FakeTrial({"a": 14.0, "b": 28.0})]],
      "m": [[_FakeTrial({"a": 4.0, "b": 30.0}), _FakeTrial({"a": 5.0, "b": None}),
             _FakeTrial({"a": 8.0, "b": 40.0})],
            [_FakeTrial({"a": 6.0, "b": 10.0}), _FakeTrial({"a": 2.0, "b": 12.0}),
             _FakeTrial({"a": None, "b": 14.0})]]}
  config = copy.deepcopy(TINY)
  config.compare.update(reference="ref", seeds=3)
  clock = types.SimpleNamespace(links={"a": None, "b": None})
  budgets, out, _ = compare_summary.summarise(trials, clock, 2.5, config, {"a": 1e9, "b": 1e9})
  assert out["m"]["a"]["study_times"] == [4.0, 2.0, 8.0]
  assert out["m"]["a"]["chosen_setting"] == [0, 1, 0]
  assert out["m"]["b"]["study_times"] == [10.0, 12.0, 14.0]
  assert out["m"]["b"]["chosen_setting"] == [1, 1, 1]
  # the geometric mean of the paired speed-ups: 2, 2, 2 on b; 10/4, 12/2, 14/8 on a
  assert out["m"]["b"]["speedup"] == pytest.approx(2.0)
  assert out["m"]["a"]["speedup"] == pytest.approx((2.5 * 6.0 * 1.75) ** (1 / 3))
  # The lists come from the method modules, the same list for every link (one training
  # serves all links), at most 5 settings.
  entry = compare.METHODS["diloco_h10"]
  tuned = compare_settings.settings_list("diloco_h10", entry, "tuned")
  assert 1 < len(tuned) <= compare_settings.MAX_SETTINGS
  assert tuned == compare_settings.settings_list("diloco_h10", entry, "tuned")
  assert [e["optimizer"].get("lr") for e in tuned[:3]] == [1e-3, 3e-3, 1e-2]
  assert all(e["sync_every"] == 10 for e in tuned)
  assert compare_settings.settings_list("diloco_h10", entry, "default") == [entry]


def test_a_tuning_list_of_more_than_5_settings_is_refused(tmp_path):
  path = tmp_path / "many.py"
  path.write_text(_readme_plugin() + "\n\ndef tuning():\n  return [{'clip': c} for c in "
                  "range(1, 7)]\n")
  with pytest.raises(ValueError, match="lists 6 settings; allowed: 1 to 5"):
    compare_settings.settings_list("many", {"method": str(path)}, "tuned")


def test_the_target_comes_from_held_out_loss_not_the_training_curve():
  """The reference's tuned setting and its per-seed best held-out loss (in config.steps
  steps) are read from the evaluations only: rewriting the training curves moves nothing."""
  trials = [[_FakeTrial({}, [(2, 3.0), (4, 2.2), (8, 1.0)]),
             _FakeTrial({}, [(2, 2.9), (4, 2.4)])],
            [_FakeTrial({}, [(2, 2.0), (4, 1.9)]), _FakeTrial({}, [(2, 2.0), (4, 1.8)])]]
  k, bests = compare_summary.reference_setting(trials, steps=4)
  assert (k, bests) == (1, [1.9, 1.8])  # step 8 is beyond the reference's 4 steps
  for seeds in trials:
    for t in seeds:
      t.history = [{"loss": 0.1}] * 4
  assert compare_summary.reference_setting(trials, steps=4) == (k, bests)
  assert stats.higher_median(bests) == 1.9


def test_profile_area_and_geometric_mean():
  times = {"a": {"x": 1.0, "y": 4.0}, "b": {"x": 2.0, "y": 2.0}, "c": {"x": math.inf,
                                                                       "y": 2.0}}
  curves, areas = stats.profile(times)
  # a: ratios 1 and 2; b: 2 and 1; c: inf and 1.
  assert curves["a"][0] == 0.5 and curves["a"][-1] == 1.0
  assert curves["c"][-1] == 0.5
  assert areas["a"] == pytest.approx((0.5 * 1.0 + 1.0 * 2.0) / 3.0, abs=0.01)
  assert areas["c"] == pytest.approx(0.5)
  assert stats.geometric_mean([2.0, 8.0, None, 0.0]) == (4.0, 2)


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


def test_compare_and_notebook_03_read_the_same_clock(summary):
  """Every trial's time axis is `sim.simulate(...).known` of its compute and communication
  (recomputed here), monotone, and notebook 03 plots and prints that clock."""
  _, result, _ = summary
  for m in result["methods"]:
    for t in m["trials"]:
      for net in t["links"].values():
        timeline = sim.simulate(m["compute_seconds_per_step"], net["comm_seconds"],
                                overlap_steps=m["overlap_steps"])
        assert net["time"] == timeline.known.tolist()
        assert np.all(np.diff(net["time"]) >= 0)
  nb = nbformat.read(os.path.join(ROOT, "colab", "03_local_updates.ipynb"), as_version=4)
  code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
  assert "timeline.known" in code and "timeline.total" in code
  assert ".done" not in code


# ---------------------------------------------------------------- the end-to-end run
def test_every_seed_trains_once_and_serves_every_link(summary, plugin):
  _, result, built = summary
  names = [compare_settings.method_config(TINY, e).method.name
           for e in (*TINY_METHODS.values(), {"method": plugin})]
  # One run built per method and seed (the default ruleset: one setting each).
  assert sorted(built) == sorted((n, s) for n in names for s in range(TINY.compare.seeds))
  assert len(result["links"]) == 3 and result["seeds"] == 2
  for m in result["methods"]:
    assert len(m["trials"]) == TINY.compare.seeds
    assert m["population"] == [True], m["method"]  # the seeds in one program
    for t in m["trials"]:
      n = t["trained_steps"]
      assert t["curve"]["step"] == list(range(1, n + 1))
      for name, net in t["links"].items():
        assert len(net["time"]) == n
        # Evaluated (untimed) at step 0, then at every step of each link's grid of simulated
        # time until the first evaluation there at or below the target (later ones change
        # no time: they are skipped unless another link needs that step), and at the last
        # step when the step cap stopped it; those are the evaluations the link reads.
        interval = result["links"][name]["eval_interval_seconds"]
        grid = compare_account.grid_steps(net["time"], interval).tolist()
        every = TINY.compare.eval_every  # and every eval_every-th step, on every link
        grid = sorted(set(grid) | set(range(0, n + 1, every)))
        loss = dict(zip(t["evals"]["step"], t["evals"]["heldout_loss"]))
        hit = next((s for s in grid if s in loss and loss[s] <= result["target_loss"]), n)
        assert t["evals"]["step"][0] == 0 == net["eval_steps"][0]
        last = [n] if n == TINY.compare.max_steps else []
        expected = [s for s in grid if s <= hit]
        expected += [s for s in last if s <= hit and s not in expected]
        assert expected == [s for s in net["eval_steps"] if s <= hit]
        assert set(net["eval_steps"]) <= (set(grid) | {*last}) & set(t["evals"]["step"])
        if m["method"] == "dp_bf16":  # the reference: its step time is constant, so its
          # grid is every eval_every steps on every link
          assert grid == list(range(0, n + 1, 2))
      # It trained until every link reached the target or spent its budget, or the cap.
      budgets = {k: v["budget_seconds"] for k, v in result["links"].items()}
      assert n == TINY.compare.max_steps or all(
          net["stopped"] == "reached" or net["time"][-1] > budgets[k]
          for k, net in t["links"].items())


def test_the_target_and_budgets_come_from_the_reference(summary):
  _, result, _ = summary
  ref = _by_method(result)["dp_bf16"]
  bests = [min(l for s, l in zip(t["evals"]["step"], t["evals"]["heldout_loss"])
               if s <= TINY.steps) for t in ref["trials"]]
  assert result["target_loss"] == stats.higher_median(bests)
  for name, link in result["links"].items():
    medians = {}
    for label in ("dp_bf16", "dp"):  # the pool: the faster stands as the link's reference
      times = []
      for t in _by_method(result)[label]["trials"]:
        counted = set(t["links"][name]["eval_steps"])
        read = [(s, l) for s, l in zip(t["evals"]["step"], t["evals"]["heldout_loss"])
                if s in counted]
        hit = [i for i, (s, l) in enumerate(read) if l <= result["target_loss"]]
        if hit:  # interpolated between the readings around the target, on the clock
          at = compare_account.crossing(read[hit[0] - 1], read[hit[0]], result["target_loss"])
          times.append(compare_account.clock_at(t["links"][name]["time"], at))
        else:
          times.append(None)
      medians[label] = stats.median_time(times)
    best = min(medians, key=medians.get)
    assert link["reference"] == best
    assert link["budget_seconds"] == pytest.approx(TINY.compare.budget * medians[best])
    assert _by_method(result)[best]["links"][name]["verdict"] == "reference"


def test_per_link_summaries_are_read_from_the_trials(summary):
  _, result, _ = summary
  for m in result["methods"]:
    for name, link in result["links"].items():
      per_seed = []
      for t in m["trials"]:
        net = t["links"][name]
        keep = [i for i, s in enumerate(t["evals"]["step"]) if s in net["eval_steps"]]
        expected = compare_account.account(
            [t["evals"]["step"][i] for i in keep],
            [t["evals"]["heldout_loss"][i] for i in keep], net["time"],
            result["target_loss"], link["budget_seconds"], TINY.compare.max_steps)
        assert {k: net[k] for k in expected} == expected
        per_seed.append(net["time_to_target"])
      a = m["links"][name]
      assert a["study_times"] == per_seed
      assert a["median"] == stats.median_time(per_seed)
      ref = _by_method(result)[link["reference"]]["links"][name]["study_times"]
      assert (a["speedup"], a["low"], a["high"]) == stats.speedup_interval(
          ref, per_seed, censor=link["budget_seconds"])[:3]


def test_a_population_in_one_program_equals_its_seeds_one_after_the_other(summary):
  """The run trained each method's seeds as one program (`Trainer(trials=S)`); the same
  seeds of DP trained one after the other give the same losses, bytes and held-out losses."""
  _, result, _ = summary
  dp = _by_method(result)["dp"]
  steps = 4
  configs = [compare_settings.seeded(compare_settings.method_config(TINY, TINY_METHODS["dp"]), s)
             for s in range(TINY.compare.seeds)]
  pop = compare_trials.train_population("dp", 0, configs, compare_settings.links(TINY),
                                 compare_trials.heldout_fn(TINY), steps, together=False)
  assert not pop.together
  for trial, t in zip(pop.trials, dp["trials"]):
    np.testing.assert_allclose([r["loss"] for r in trial.history], t["curve"]["loss"][:steps],
                               rtol=1e-5)
    assert trial.step_bytes.tolist() == t["curve"]["wire_bytes"][:steps]
    run = dict(zip(t["evals"]["step"], t["evals"]["heldout_loss"]))
    both = [(v, run[s]) for s, v in trial.evals if s in run]  # the steps both evaluated
    assert both
    np.testing.assert_allclose(*zip(*both), rtol=1e-5)


def test_methods_with_the_same_local_step_share_one_compute_figure(summary):
  _, result, _ = summary
  by = _by_method(result)
  inner = {by[m]["compute_seconds_per_step"] for m in ("dp", "dp_bf16", "streaming")}
  assert len(inner) == 1 and {by[m]["compute_key"] for m in ("dp", "dp_bf16", "streaming")} \
      == {"inner"}
  assert by["dp"]["compute_seconds_per_step"] == result["compute"]["inner"]["seconds"]
  for label in ("topk1%_ef", "my_method"):  # their own local steps, timed in the same rounds
    key = by[label]["compute_key"]
    assert key != "inner" and key.startswith(label)
    assert by[label]["compute_seconds_per_step"] == result["compute"][key]["seconds"]
  for figure in result["compute"].values():
    assert figure["min"] <= figure["seconds"] <= figure["max"]
    assert figure["repeats"] == TINY.compare.compute_repeats
  shares = result["compute_shares"]["inner"]
  assert shares["forward"] > 0 and shares["backward"] > shares["forward"]
  assert shares["forward"] + shares["backward"] + shares["update"] == pytest.approx(1.0)


def test_overlapped_data_parallelism_on_the_clock(summary):
  """DP's step on each link: compute plus the communication its buckets leave exposed after
  the backward pass (`sim.backward_overlap`), never more than the serial all-reduce; one
  step of DP is the compiled all-reduce's time when it cannot hide anything."""
  _, result, _ = summary
  by = _by_method(result)
  for label in ("dp", "dp_bf16", "topk1%_ef"):
    m = by[label]
    assert m["overlap_backward"]
    for name, link in result["links"].items():
      t = m["trials"][0]
      exposed = t["links"][name]["comm_seconds"][0]
      compute = m["compute_seconds_per_step"]
      np.testing.assert_allclose(t["links"][name]["time"],
                                 (compute + exposed) * np.arange(1, t["trained_steps"] + 1),
                                 rtol=1e-9)
  # DP f32 on InfiniBand: the all-reduce of one step is well under its backward pass, so
  # most of it hides; on the WAN (30 ms a message) little can.
  dp = by["dp"]["trials"][0]["links"]
  ring = comm.wire_bytes_time(by["dp"]["wire_bytes_per_step"], specs.parse_link("wan"),
                              group_size=W, algorithm="auto")
  assert dp["wan"]["comm_seconds"][0] <= ring + 1e-12
  assert not by["streaming"]["overlap_backward"] and not by["my_method"]["overlap_backward"]


def test_writes_tables_verdicts_report_figures_and_json(summary, plugin):
  workdir, result, _ = summary
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    saved = json.load(f)
  labels = list(TINY_METHODS) + ["my_method"]
  assert [m["method"] for m in saved["methods"]] == labels
  assert saved["verdicts"] == result["verdicts"] and len(saved["verdicts"]) == 3
  for name, verdict in zip(result["links"], result["verdicts"]):
    assert verdict.startswith(f"{name}: ")
    assert re.search(r"\(95 % CI [\d.]+-[\d.]+x, \d/2 seeds", verdict), verdict
  text = result["text"]
  for label in labels:  # the plugin is in every link's table
    assert text.count(f"\n{label} ") == 3, label
  with open(os.path.join(workdir, "report.md"), encoding="utf-8") as f:
    md = f.read()
  for v in result["verdicts"] + result["sensitivity"]:
    assert f"* {v}" in md
  assert "compute -20 %" in md and "compute +20 %" in md
  assert "| my_method | " in md and plugin in md  # its row, and its module in the settings
  assert md.count("| method | bytes/step (mean) |") == 3 and md.count("| seed 0 | seed 1 |") == 3
  assert "95 % t-interval on the paired log speed-ups over 2 seeds" in md
  assert "| inner | " in md and "profile area" in md
  assert "`--failures=none` (the default): nothing fails." in md
  for name in ("loss_vs_time.png", "loss_vs_bytes.png", "profile.png"):
    image = matplotlib.image.imread(os.path.join(workdir, name))
    assert image.ndim == 3 and image.shape[0] > 100 and image.std() > 0
  for label, s in saved["scores"].items():
    assert 0 <= s["area"] <= 1 and len(s["profile"]) == len(stats.TAUS), label


# ---------------------------------------------------------------- the plugin
def test_a_plugin_in_a_tmp_folder_is_in_the_table_with_its_overlap(summary, plugin):
  _, result, _ = summary
  mine = _by_method(result)["my_method"]
  assert mine["algo"] == plugin and mine["method_settings"]["clip"] == 1.0
  assert mine["overlap_steps"] == 1  # its module's overlap_steps, on the clock
  wan = mine["trials"][0]["links"]["wan"]
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


# ---------------------------------------------------------------- links
@pytest.mark.parametrize("spec, gbit, latency", [
    ("office:gbit=0.5,latency_ms=40", 0.5, 0.04),
    (" lab-2:latency_ms=0.005, gbit=100 ", 100.0, 5e-6),
    ("wan", 1.0, 0.03),
    ("internet", 0.1, 0.04),
])
def test_link_specs(spec, gbit, latency):
  link = specs.parse_link(spec)
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
    ("x:gbit=0,latency_ms=1", r"gbit must be a finite number in \(0, inf\), got 0.0"),
    ("x:gbit=inf,latency_ms=1", r"gbit must be a finite number in \(0, inf\), got inf"),
    ("x:gbit=1,latency_ms=-3", r"latency_ms must be a finite number in \[0, inf\), got -3.0"),
    ("x:gbit=1,gbit=2,latency_ms=1", "gbit is given twice"),
])
def test_bad_link_specs_name_the_wrong_part(spec, words):
  with pytest.raises(ValueError, match=words):
    specs.parse_link(spec)


@pytest.mark.slow
def test_the_program_exits_1_with_one_line_and_help_lists_config(tmp_path):
  """`python -m experiments.compare` runs on experiments._cli: a bad setting is one line on
  stderr, exit status 1, nothing written; --help lists --config with the program's flags."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  workdir = tmp_path / "compare"
  result = subprocess.run([sys.executable, "-m", "experiments.compare", "--budget=0.5",
                           f"--workdir={workdir}"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300, check=False)
  assert result.returncode == 1 and not workdir.exists()
  assert result.stderr.strip().splitlines() == [
      "error: config.compare.budget must be a finite number in [1, inf), got 0.5."],\
      result.stderr
  usage = subprocess.run([sys.executable, "-m", "experiments.compare", "--help"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
                         check=False).stdout
  for words in ("--config:", "--config.<path>=<value>", "--[no]verbose:", "--ruleset:",
                "--workdir:"):
    assert words in usage, (words, usage[-3000:])


def test_link_flags_and_bad_settings_fail_before_anything_trains(tmp_path):
  c = compare_settings.with_flags(TINY, ["wan"], ["office:gbit=0.5,latency_ms=40"], budget=2.0,
                         max_steps=20)
  assert list(compare_settings.links(c)) == ["wan", "office"]
  assert (c.compare.budget, c.compare.max_steps) == (2.0, 20)
  custom = compare_settings.with_flags(TINY, custom=["x:gbit=1,latency_ms=1"])
  assert compare_settings.links(custom).keys() == {"wan", "internet", "infiniband", "x"}
  for bad, words in ((compare_settings.with_flags(TINY, ["wan", "wan"]), "twice"),
                     (compare_settings.with_flags(TINY, ["nope"]), "'nope' is not a preset"),
                     (compare_settings.with_flags(TINY, budget=0.0), "budget"),
                     (compare_settings.with_flags(TINY, max_steps=3), "max_steps")):
    with pytest.raises(ValueError, match=words):
      compare.run(bad, str(tmp_path), ["dp"], verbose=False, catalog=TINY_METHODS)
  with pytest.raises(ValueError, match="ruleset must be one of 'default', 'tuned'; got"):
    compare.run(compare_settings.with_flags(TINY, ruleset="best"), str(tmp_path), ["dp"],
                verbose=False, catalog=TINY_METHODS)
  c = compare_settings.with_flags(TINY, ruleset="tuned", seeds=5, target_loss=2.0)
  assert (c.compare.ruleset, c.compare.seeds, c.compare.target_loss) == ("tuned", 5, 2.0)
  with pytest.raises(ValueError, match="must be one of 'dp_bf16'"):
    compare.resolve_methods(["nope"], TINY_METHODS)
  with pytest.raises(ValueError, match="no such file"):
    compare.resolve_methods([str(tmp_path / "missing.py")], TINY_METHODS)
  assert not os.listdir(tmp_path)


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
  for m in result["methods"]:
    for t in m["trials"]:
      assert np.all(np.isfinite(t["curve"]["loss"]))
      assert np.all(np.isfinite(t["evals"]["heldout_loss"]))
  # Seeds differ (initial parameters, batches): their first losses are not the same.
  assert dp["trials"][0]["curve"]["loss"][0] != dp["trials"][1]["curve"]["loss"][0]
  # The WAN is slower than InfiniBand for the same trials.
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
    for t in m["trials"]:
      sent = t["curve"]["wire_bytes"]
      if m["algo"] == "streaming_diloco":
        assert every == 0 and cond > 0
        periods = len(sent) // H * H
        # Counters round each sync's bytes to whole bytes.
        assert np.mean(sent[:periods]) == pytest.approx(
            TINY_METHODS["streaming"]["fragments"] * cond / H, abs=1.0)
      else:
        assert cond == 0
        assert np.mean(sent) == pytest.approx(every, abs=1.0), m["method"]


def test_ratios_are_against_exact_dp_compiled_on_the_same_mesh(summary):
  _, result, _ = summary
  by = _by_method(result)
  dp_bytes = by["dp"]["inspected_wire_bytes"]["every_step"]
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


def test_dp_bf16_changes_the_updates_but_little(summary):
  _, result, _ = summary
  by = _by_method(result)
  dp, bf16 = (by[k]["trials"][0]["curve"]["loss"] for k in ("dp", "dp_bf16"))
  n = min(len(dp), len(bf16))
  dp, bf16 = np.array(dp[:n]), np.array(bf16[:n])
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
    cfg = compare_settings.method_config(TINY, compare.METHODS[label])
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
  # The reference is bf16 DP (overlapped with the backward pass, like f32 DP).
  assert compare_config.get_config().compare.reference == "dp_bf16"
  assert build.load_method("dp").overlap_backward(None)


def test_more_methods_run_only_when_named():
  """DES-LOC, NoLoCo and eager DiLoCo are labels `--methods` may name; `make run` (every
  label of METHODS) does not run them. Each entry's settings build a valid config."""
  assert not set(compare.MORE_METHODS) & set(compare.resolve_methods(None))
  chosen = compare.resolve_methods(["noloco_h10", "des_loc_k10"])
  assert list(chosen)[1:] == ["noloco_h10", "des_loc_k10"]  # after the reference
  base = compare_config.get_config()
  for label, entry in compare.MORE_METHODS.items():
    c = compare_settings.method_config(base, entry)
    assert c.method.name == entry["method"], label
    build.build(c, abstract=True)  # the method's settings are accepted by its factory


@pytest.mark.parametrize("entry, named", [
    ({"method": "dp", "optimizer": {"lrr": 1e-3}}, "'lrr'"),
    ({"method": "diloco", "sync_evry": 2}, "'sync_evry'"),
    ({"method": "dp", "mesh": "data=8"}, None),
])
def test_a_method_entry_is_checked_as_in_every_program(entry, named):
  # compare applies an entry through config.with_method: a misspelt method or optimizer
  # setting is refused by name, and a "mesh" is the run's mesh, not a method setting.
  if named:
    with pytest.raises(ValueError, match=named):
      compare_settings.method_config(TINY, entry)
  else:
    assert compare_settings.method_config(TINY, entry).mesh == entry["mesh"]
