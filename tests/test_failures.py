"""The failure model on the simulated clock (jaxcomm/sim/_failures.py, _goodput.py).

Checkpoint/restart is held against its exact renewal closed form and against Young's
first-order rule and optimum (Young 1974; Daly 2006); the elastic and decoupled event
simulations against their first-order formulas where failures are rare; the quorum test the
simulation uses against `jaxcomm.elastic.Quorum` itself; the stragglers' expected maximum
against draws of the maximum. Everything here is numpy: no JAX program runs.
"""

import itertools
import math

import numpy as np
import pytest

from jaxcomm import elastic, sim
from jaxcomm.sim import _events

# A job of 1000 devices whose MTBF is 2 h: failures every 2 h, saves of 60 s, a restart of
# 10 minutes plus 30 s to notice, a restore of 2 minutes.
MODEL = sim.failure_model("mtbf_h=2000,checkpoint_s=60,restore_s=120,restart_s=600,detect_s=30")
N = 1000


def exact(model, devices, every):
  """The expected time per saved interval, written out here from the renewal argument:
  S = (e^(l a) - 1)(1/l + R + (e^(l D) - 1)(1/l + R)), a = T + C."""
  lam = devices / (model.mtbf_h * 3600)
  r = model.restart_s + model.detect_s
  restore = (math.exp(lam * model.restore_s) - 1) * (1 / lam + r)
  return every / ((math.exp(lam * (every + model.checkpoint_s)) - 1) * (1 / lam + r + restore))


def test_checkpoint_goodput_is_the_renewal_closed_form_and_young_is_its_optimum():
  for every in (100.0, 600.0, 2400.0):
    assert sim.checkpoint_goodput(MODEL, N, every) == pytest.approx(exact(MODEL, N, every),
                                                                    rel=1e-12)
  # Young's interval sqrt(2 C MTBF / N) = sqrt(2 x 60 x 7200) = 929.5 s.
  assert sim.young_interval(MODEL, N) == pytest.approx(math.sqrt(2 * 60 * 7200))
  grid = np.geomspace(50, 20000, 400)
  best = grid[np.argmax([exact(MODEL, N, t) for t in grid])]
  # The exact optimum sits near Young's interval (first order: C << MTBF / N), and Young's
  # interval loses under half a percent of goodput against it.
  assert best == pytest.approx(sim.young_interval(MODEL, N), rel=0.15)
  assert sim.checkpoint_goodput(MODEL, N) > 0.995 * exact(MODEL, N, best)
  # Young's first-order goodput 1 / (1 + C/T + (N/MTBF)(T/2 + R + D)) converges on the
  # exact one as failures become rare: the gap shrinks with the rate.
  gaps = [abs(sim.first_order_goodput(m, N) - sim.checkpoint_goodput(m, N)) for m in (
      MODEL._replace(mtbf_h=h) for h in (2e3, 2e4, 2e5))]
  assert gaps[0] < 0.03 and gaps[1] < gaps[0] / 2 and gaps[2] < gaps[1] / 2, gaps


def test_checkpoint_restart_simulation_matches_the_closed_form():
  """Event by event (failures during restores too), three seeds of ~4000 failures each."""
  runs = [sim.simulate_failures(MODEL, N, sim.Semantics(), 1.0, horizon_s=3e7, seed=s)
          for s in range(3)]
  assert all(r.failures > 3000 for r in runs)
  assert np.mean([r.goodput for r in runs]) == pytest.approx(sim.checkpoint_goodput(MODEL, N),
                                                             abs=0.005)
  # Without failures: only the saves cost anything.
  none = sim.simulate_failures(MODEL._replace(mtbf_h=math.inf), N, sim.Semantics(), 1.0,
                               work_s=1e4)
  assert none.failures == 0 and none.wall[-1] == 1e4   # Young's interval is infinite: no saves


@pytest.mark.parametrize("kind,units,round_steps", [("elastic", 8, 100), ("decoupled", 8, 25)])
def test_elastic_and_decoupled_simulations_match_their_first_order_goodput(kind, units,
                                                                         round_steps):
  semantics = sim.Semantics(kind, units, round_steps)
  runs = [sim.simulate_failures(MODEL, N, semantics, 1.0, horizon_s=3e7, seed=s)
          for s in range(2)]
  expected = sim.expected_goodput(MODEL, N, semantics, 1.0)
  assert 0.95 < expected < 0.995
  assert np.mean([r.goodput for r in runs]) == pytest.approx(expected, abs=0.005)


def test_methods_rank_as_the_failure_semantics_say_at_every_scale():
  """The analytic-free large-scale path: 16 to 10^6 devices, one day, in well under a second
  each. With 256-device replicas the synchronous job falls off first; at 10^6 devices an
  elastic round is cut by a failure somewhere almost every time, and only learners that
  never wait keep their goodput."""
  model = sim.failure_model("yearly")
  for devices in (16, 4096, 10**6):
    units = max(1, devices // 256)
    got = {kind: sim.simulate_failures(model, devices, sim.Semantics(kind, units, 100), 1.0,
                                       horizon_s=86400.0, seed=0).goodput
           for kind in ("restart", "elastic", "decoupled")}
    assert got["restart"] <= got["elastic"] + 0.01 <= got["decoupled"] + 0.02, (devices, got)
  assert got["restart"] < 0.01 and got["elastic"] < 0.2 and got["decoupled"] > 0.98, got


def test_the_simulation_keeps_the_runtime_quorum_rules():
  """`quorum_ok` from counts is `elastic.Quorum.violations(...) == []` on every small case."""
  for quorum in (elastic.Quorum(), elastic.Quorum(min_workers=3),
                 elastic.Quorum(min_workers=2, majority=False),
                 elastic.Quorum(min_workers=lambda step: 4 if step >= 10 else 1)):
    for n, step in itertools.product(range(1, 6), (0, 10)):
      for last in itertools.chain.from_iterable(
          itertools.combinations(range(n), r) for r in range(n + 1)):
        for live in itertools.chain.from_iterable(
            itertools.combinations(range(n), r) for r in range(n + 1)):
          kept = len(set(live) & set(last))
          assert _events.quorum_ok(quorum, len(live), kept, len(last), step) == (
              not quorum.violations(live, last, step)), (quorum, live, last, step)


def test_two_replicas_under_majority_wait_for_the_lost_one():
  """Majority of the last quorum: with two replicas, losing one stops the run until it is
  back (the runtime's rule); without the rule the survivor trains on."""
  model = sim.failure_model("mtbf_h=1,restart_s=600,detect_s=0")
  wait = sim.simulate_failures(model, 2, sim.Semantics("elastic", 2, 10), 1.0,
                               horizon_s=2e5, seed=1)
  go_on = sim.simulate_failures(model, 2, sim.Semantics(
      "elastic", 2, 10, elastic.Quorum(majority=False)), 1.0, horizon_s=2e5, seed=1)
  assert wait.goodput < go_on.goodput - 0.05, (wait.goodput, go_on.goodput)


def test_time_to_reads_the_first_passage_through_lost_work():
  run = sim.FailureRun(np.array([0.0, 10.0, 10.0, 15.0, 30.0]),
                       np.array([0.0, 10.0, 4.0, 4.0, 19.0]), 1)
  # Progress 8 is first reached at t = 8 (the work lost at 10 does not un-reach it); 12 only
  # after the restart: 15 + (12 - 4).
  np.testing.assert_allclose(run.time_to([0.0, 8.0, 12.0, 19.0, 20.0]),
                             [0.0, 8.0, 23.0, 30.0, np.inf])
  assert run.goodput == pytest.approx(19 / 30)


def test_stragglers_expected_maximum_matches_draws_of_the_maximum():
  model = sim.failure_model("straggler_p=0.01,straggler_scale=0.5,straggler_alpha=3")
  for devices in (1, 100, 10**5):
    drawn = sim.step_slowdowns(model, devices, 200000, seed=0)
    assert drawn.mean() == pytest.approx(sim.expected_slowdown(model, devices), rel=0.01)
  # One device: 1 + p scale / (alpha - 1), the Lomax mean.
  assert sim.expected_slowdown(model, 1) == pytest.approx(1 + 0.01 * 0.5 / 2, rel=1e-6)
  slow = sim.simulate_failures(model, 10**5, sim.Semantics(), 1.0, work_s=100.0)
  assert slow.wall[-1] == pytest.approx(100 * sim.expected_slowdown(model, 10**5))


@pytest.mark.parametrize("spec,match", [
    ("mtbf_h=-5", "mtbf_h must be a finite number in \\(0.0, inf\\)"),
    ("llama3,restart_s=-1", "restart_s must be a finite number in \\[0.0, inf\\)"),
    ("llama4", "unknown preset 'llama4'; allowed: none, llama3, yearly"),
    ("mtbf=3", "unknown setting 'mtbf'"),
    ("mtbf_h=abc", "mtbf_h must be a number"),
    ("straggler_alpha=1", "straggler_alpha"),
])
def test_bad_failure_settings_name_the_setting(spec, match):
  with pytest.raises(ValueError, match=match):
    sim.failure_model(spec)


def test_bad_semantics_name_the_setting():
  with pytest.raises(ValueError, match="min_workers \\(5\\) must be <= units \\(4\\)"):
    sim.Semantics("elastic", 4, 10, elastic.Quorum(min_workers=5)).check(16)
  with pytest.raises(ValueError, match="semantics must be one of"):
    sim.Semantics("async").check(16)
  with pytest.raises(ValueError, match="units must be an integer in \\[1, 16\\]"):
    sim.Semantics("decoupled", 32).check(16)


def test_presets_cite_their_figures():
  assert sim.failure_model("llama3").mtbf_h == pytest.approx(16384 * 54 * 24 / 419)
  assert sim.failure_model("yearly").mtbf_h == 8760
  assert sim.failure_model("none").rate == 0
  assert set(sim.FAILURE_PRESETS) == {"none", "llama3", "yearly"}


@pytest.mark.slow
def test_a_drawn_schedule_replayed_in_a_real_elastic_run_matches_its_simulation(tmp_path):
  """experiments/failure_replay.py on 3 processes, DiLoCo with H = 5, 60 steps: the model's
  draw (seed 1) kills process 2 before step 22 and restarts it at once. The simulation of
  the same failure, with the platform's latencies read from the run's failure-free start,
  predicts the measured goodput within a factor of 2 (the stated, loose bound: the machine's
  load moves both start-ups and compiles). 60 steps, not 40 (the same draw): the simulated
  work of 40 (35 steps of ~10 ms) could end before the kill's measured time, which the first
  rounds' overheads push past step 22's nominal one (measured 0.047 against a simulated 1.0
  once, with no failure in the simulation). The run ends before process 2 is back; the
  launcher ends it 2 s after the others finished (`grace_s`, 10 by default)."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.failure_replay", f"--workdir={tmp_path}",
       "--config.steps=60", "--config.seed=1", "--config.grace_s=2"], capture_output=True,
      text=True, cwd=root,
      env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root), timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(tmp_path / "replay.json", encoding="utf-8") as f:
    out = json.load(f)
  assert out["kills"] == [{"step": 22, "process": 2}]
  measured, simulated = out["measured"]["goodput"], out["simulated_goodput"]
  assert 0 < measured < 1 and 0 < simulated < 1
  assert 0.5 <= measured / simulated <= 2.0, (measured, simulated, out["measured"])


def test_method_modules_declare_the_semantics_the_elastic_runtime_gives_them():
  """A method module with a sync period (the rounds `jaxcomm.elastic` runs it in,
  experiments/elastic_run.py) declares elastic semantics with those rounds, Decoupled DiLoCo
  its learners' deliveries; every other method declares nothing and is synchronous (restart
  from the last checkpoint)."""
  from experiments import build, config, elastic_run, methods
  from experiments.compare import failures
  for name in build.available_methods():
    settings = config.base_config(name).method
    got = failures.semantics(settings, 4)
    if name == "decoupled_diloco":
      assert got == sim.Semantics("decoupled", 4, settings.sync_every // settings.fragments)
    elif hasattr(methods.load_method(name), "period"):
      assert got == sim.Semantics("elastic", 4, elastic_run.round_steps(settings)), name
    else:
      assert got == sim.Semantics(), name


def test_a_method_that_declares_nothing_is_synchronous(tmp_path):
  from experiments import methods
  path = tmp_path / "quiet.py"
  path.write_text("from experiments.methods import dp\ndefaults = dp.defaults\n"
                  "build = dp.build\n")
  assert methods.hooks(str(path)).failure_semantics(None) == sim.Semantics()
