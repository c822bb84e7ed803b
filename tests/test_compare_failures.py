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
    ("llama4", "--failures: failures: unknown preset 'llama4'"),
    ("", "--failures must be 'none', a preset"),
    ("mtbf_h=-1", "--failures: mtbf_h must be"),
])
def test_bad_failures_flag_is_one_line_naming_it(spec, match):
  with pytest.raises(ValueError, match=match):
    failures.model(spec)
