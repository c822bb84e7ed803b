"""The comparison's second score (experiments/compare/failures.py): time to the target and
goodput under a failure model, on failure-free times given here (no training)."""

import math

import numpy as np
import pytest

from experiments.compare import failures
from jaxcomm import sim

LINKS = ("wan", "internet")
# Failure-free times to the target (3 training seeds) and seconds per step: DP is faster
# without failures on both links.
TIMES = {"dp": {"wan": [1000.0, 1100.0, 1050.0], "internet": [3000.0, 3100.0, None]},
         "diloco": {"wan": [1300.0, 1250.0, 1400.0], "internet": [2000.0, 2100.0, 2050.0]}}
STEP = {m: {n: 1.0 for n in LINKS} for m in TIMES}
SEMANTICS = {"dp": sim.Semantics(), "diloco": sim.Semantics("elastic", 8, 10)}
REFS = {n: "dp" for n in LINKS}


def test_without_failures_the_second_score_is_the_first():
  model = sim.failure_model("none")
  out = failures.summarise(TIMES, STEP, SEMANTICS, model, 64, 2, REFS)
  assert out["dp"]["wan"]["times"] == [1000.0, 1000.0, 1100.0, 1100.0, 1050.0, 1050.0]
  assert out["dp"]["internet"]["median"] == 3100.0
  assert math.isinf(out["dp"]["internet"]["times"][-1])
  assert out["dp"]["wan"]["goodput"] == 1.0 and out["diloco"]["wan"]["goodput"] == 1.0
  assert out["diloco"]["wan"]["verdict"] == "slower"


def test_failures_turn_the_verdict_and_the_lines_say_which_score():
  """64 devices whose MTBF is 10 h each (a failure every ~9 minutes): DP restarts from its
  checkpoint each time, DiLoCo's replicas lose one round; DiLoCo reaches the target first."""
  model = sim.failure_model("mtbf_h=10,restart_s=300,detect_s=10,checkpoint_s=30,"
                            "restore_s=60")
  out = failures.summarise(TIMES, STEP, SEMANTICS, model, 64, 5, REFS)
  dp, dl = out["dp"]["wan"], out["diloco"]["wan"]
  assert len(dp["times"]) == 15 and dp["median"] > 2 * 1050.0
  assert dl["goodput"] > 0.8 > 0.5 > dp["goodput"]
  assert dl["verdict"] == "faster", dl
  line = failures.verdict(out, "wan", "dp", model, 3.21)
  assert line.startswith("wan [time to target under failures, custom]: diloco reaches")
  scores = failures.profile(out)
  assert scores["diloco"]["area"] == 1.0 > scores["dp"]["area"]
  assert [r[:2] for r in failures.rows(out, "wan")] == [["dp", "restart"],
                                                         ["diloco", "elastic"]]
  # The same draws every time: the score is reproducible.
  again = failures.summarise(TIMES, STEP, SEMANTICS, model, 64, 5, REFS)
  assert again["dp"]["wan"]["times"] == dp["times"]
  assert np.isfinite(dl["low"]) and dl["low"] > 1


@pytest.mark.parametrize("spec,match", [
    ("llama4", "--failures: unknown preset 'llama4'"),
    ("", "--failures must be 'none', a preset"),
    ("mtbf_h=-1", "--failures: mtbf_h must be"),
])
def test_bad_failures_flag_is_one_line_naming_it(spec, match):
  with pytest.raises(ValueError, match=match):
    failures.model(spec)


def _record(method, settings, replicas, times, seconds_per_step=1.0, steps=4):
  """A results.json method record as compare.run writes it, with only what failures reads."""
  known = [seconds_per_step * (i + 1) for i in range(steps)]
  return {"method": method, "method_settings": settings, "replicas": replicas,
          "links": {n: {"study_times": times[n]} for n in LINKS},
          "trials": [{"links": {n: {"time": known} for n in LINKS}}]}


def test_the_comparison_reads_each_methods_semantics_and_clock_from_its_record():
  """failures.extra (what compare.run calls with --failures): DP's module declares restart
  (one unit), DiLoCo's elastic rounds of H steps over its record's 8 replicas; seconds per
  step from the trial's clock (4 steps in 4 s); the same numbers as summarise on them."""
  from experiments import config
  records = [_record("dp", config.base_config("dp").method.to_dict(), 8, TIMES["dp"]),
             _record("diloco", config.base_config("diloco").method.to_dict(), 8,
                     TIMES["diloco"])]
  spec = "mtbf_h=10,restart_s=300,detect_s=10,checkpoint_s=30,restore_s=60"
  found = failures.extra(records, list(LINKS), spec, 5, 64, REFS, 3.21)
  direct = failures.summarise(TIMES, STEP, SEMANTICS, sim.failure_model(spec), 64, 5, REFS)
  for m in TIMES:
    for n in LINKS:
      assert found["summary"][m][n]["times"] == direct[m][n]["times"], (m, n)
  assert found["summary"]["diloco"]["wan"]["units"] == 8
  assert found["summary"]["dp"]["wan"]["units"] == 1
  assert found["verdicts"][0].startswith("wan [time to target under failures, custom]")
  assert "### internet" in failures.markdown(found, spec, list(LINKS))
  assert failures.extra(records, list(LINKS), "none", 5, 64, REFS, 3.21) is None
  assert "(the default): nothing fails" in failures.markdown(None, "none", list(LINKS))


@pytest.mark.parametrize("setting,value,words", [
    ("failures", "llama4", "--failures: unknown preset 'llama4'"),
    ("failures", "mtbf_h=1,restart_s=-5", "--failures: restart_s must be"),
    ("failure_draws", 0, "config.compare.failure_draws must be"),
])
def test_a_bad_failure_setting_stops_the_comparison_before_anything_runs(
    tmp_path, setting, value, words):
  from experiments import compare
  from experiments.configs import compare as compare_config
  config = compare_config.get_config()
  config.compare[setting] = value
  with pytest.raises(ValueError) as e:
    compare.run(config, str(tmp_path / "out"), ["dp_bf16"], verbose=False)
  assert words in str(e.value) and "\n" not in str(e.value)
  assert not (tmp_path / "out").exists()
