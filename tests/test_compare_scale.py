"""experiments.compare at a scenario's scale (config.compare.scale = "scenario"): the proxy
trains with the scenario's replicas, each method's step is planned at the scenario's size on
its sites (a model file of one's own here: a small LM on 2 sites x 4 devices), and a time
to the target is the scenario's clock at the proxy's steps. One tiny run serves the module.
"""

import json
import os

import numpy as np
import pytest

from experiments import compare
from experiments.compare import scale as compare_scale
from experiments.compare import settings as compare_settings
from experiments.compare import transfer
from experiments.configs import compare as compare_config
from jaxcomm import comm

MODEL = '''
def get_config():  # a scenario's model of one's own: the form of experiments/configs/models/
  return {"model": {"name": "lm", "d_model": 32, "num_layers": 3, "num_heads": 2, "d_ff": 64,
                    "vocab_size": 256},
          "data": "pydoc", "seq_len": 32, "batch_per_device": 2, "note": "a small LM"}
'''
METHODS = {label: compare.METHODS[label] for label in ("dp_bf16", "dp")}
METHODS["diloco"] = {"method": "diloco", "sync_every": 3}


def _config(tmp_path):
  c = compare_config.get_config()
  c.steps = 6
  c.data.update(batch_size=16, seq_len=16)
  c.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
  c.compare.update(smooth=2, max_steps=12, seeds=2, eval_every=2, eval_batch=8,
                   links=("wan", "infiniband"))
  model = tmp_path / "my_model.py"
  model.write_text(MODEL)
  c.compare.scenario.update(model=str(model), sites=2, per_site=4, inner="fsdp",
                            plan_cache=str(tmp_path / "plans"))
  c.compare.failures = "mtbf_h=1e12"  # the second score, wired; nothing fails in the run
  return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("scale")
  config = _config(tmp)
  workdir = str(tmp / "out")
  out = compare.run(config, workdir, list(METHODS), verbose=True, catalog=METHODS)
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    saved = json.load(f)
  with open(os.path.join(workdir, "report.md"), encoding="utf-8") as f:
    md = f.read()
  return config, out, saved, md


@pytest.mark.slow
def test_the_proxy_trains_with_the_scenarios_replicas(run):
  config, _, saved, _ = run
  assert saved["proxy_mesh"] == "replica=2,data=4"
  assert {r["method"]: r["replicas"] for r in saved["methods"]} == dict.fromkeys(METHODS, 2)
  assert saved["scale"]["mesh"] == "replica=2,fsdp=4" and saved["scale"]["sites"] == 2


@pytest.mark.slow
def test_a_time_to_the_target_is_the_scenarios_clock_at_the_proxys_steps(run):
  _, _, saved, _ = run
  for r in saved["methods"]:
    for t in r["trials"]:
      for name, a in t["links"].items():
        if a["time_to_target"] is None:
          continue
        known = np.asarray(a["time"])  # the scenario's clock of the steps trained
        at = a["steps_to_target"]  # between two readings, the clock linear between steps
        before = max(s for s in a["eval_steps"] if s < at)
        assert before < at <= min(s for s in a["eval_steps"] if s >= at)
        whole = int(np.floor(at))
        clock = (known[whole - 1] if whole else 0.0) + (at - whole) * (
            known[whole] - (known[whole - 1] if whole else 0.0)) if at < len(known) else \
            known[-1]
        assert a["time_to_target"] == pytest.approx(clock)
        # the clock is the plan's: its mean step over a whole number of DiLoCo periods
        step = r["scale"]["links"][name]["step"]
        n = 6 if r["method"] == "diloco" else 1
        assert known[n - 1] == pytest.approx(n * step, rel=1e-9)


@pytest.mark.slow
def test_dp_sends_its_shard_across_sites_and_is_charged_by_hand(run):
  """DP on replica=2, fsdp=4: the all-reduce across the 2 sites carries each device's shard
  of the gradient (the 2-device all-reduce's wire bytes are its operand's: 2 (2 - 1) / 2),
  i.e. the parameters' bytes on a device; bf16 DP half of it. On the WAN each of the 4
  devices of a site gets 1/4 of 1 Gbit/s: one message of 30 ms (recursive doubling, the
  fastest at 2 devices) plus the bytes at 31.25 MB/s."""
  config, _, saved, _ = run
  sc = compare_scale.scenario(compare_settings.at_scale(config))
  planner = compare_scale.Planner({("dp", 0): compare_settings.method_config(
      config, METHODS["dp"])}, sc)
  assert planner.plans.planned == 0  # the run's plan, read back from the cache
  clock, failed = planner.clock(compare_settings.links(config), ["dp"])
  assert not failed
  step = clock.plans[("dp", 0)]
  across = step.report.select(axes=("replica",))
  shard = step.state_bytes["params"]
  assert sum(c.total_bytes for c in across) == shard
  methods = saved["scale"]["methods"]
  assert methods["dp"]["bytes_per_axis"]["replica"] == shard
  assert methods["dp_bf16"]["bytes_per_axis"]["replica"] == pytest.approx(shard / 2, rel=1e-3)
  costed = comm.cost(comm.CollectiveReport(tuple(across)), sc.network(comm.preset("wan")))
  assert costed.seconds() == pytest.approx(len(across) * 0.03 + shard / (125e6 / 4))


@pytest.mark.slow
def test_the_report_says_where_each_number_comes_from(run):
  _, out, saved, md = run
  assert "## The scenario" in md and ("Scenario: my_model.py (a small LM) on 2 sites x 4 "
                                      "devices (mesh replica=2,fsdp=4" in md)
  assert "Steps to the target come from the proxy (the LM below, trained on replica=2,data=4" \
      in md
  assert "wan (1 Gbit/s per site, shared by its 4 devices that send at once" in md
  assert "## The same trials on the proxy's own clock" in md and "## Step time at scale" in md
  assert "interpolated between the two readings around it" in md
  assert "read every 2 steps, at step 0 and at the step cap" in md
  assert "t-interval on the paired log speed-ups over 2 seeds" in md
  assert len(saved["proxy_clock"]["verdicts"]) == 2 and len(out["verdicts"]) == 2
  for v in out["verdicts"] + saved["proxy_clock"]["verdicts"]:
    assert f"* {v}" in md
  assert "| method | bytes across sites/step |" in md


@pytest.mark.slow
def test_step_time_is_the_clocks_step_for_one_method(run):
  config, _, saved, _ = run
  p = compare.step_time(METHODS["diloco"], config, "wan")
  assert p.step == pytest.approx(saved["scale"]["methods"]["diloco"]["links"]["wan"]["step"])
  assert p.step == pytest.approx(p.compute + p.exposed)


@pytest.mark.parametrize("setting, value, words", [
    ("sites", 3, "config.compare.scenario.sites (3) must divide the proxy's 8 devices"),
    ("model", "gpt5", "config.compare.scenario.model must be one of 'gpt2_124m'"),
    ("mfu", 1.5, "config.compare.scenario.mfu must be a number in (0, 1]"),
    ("inside", "lan:gbit=-1,latency_ms=1", "gbit must be a finite number in (0"),
    ("device", "tpu_v9", "config.compare.scenario.device must be one of 'a100'"),
])
def test_bad_scenarios_are_one_line_naming_the_setting_and_nothing_is_written(
    tmp_path, setting, value, words):
  config = _config(tmp_path)
  config.compare.scenario[setting] = value
  with pytest.raises(ValueError) as e:
    compare.run(config, str(tmp_path / "out"), list(METHODS), verbose=False, catalog=METHODS)
  assert words in str(e.value) and "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "out")


def test_the_transfer_check_ranks_steps_to_the_target_relative_to_dp():
  config = compare_config.get_config()
  big = transfer.larger(config)
  small_n, big_n = transfer.parameters(config), transfer.parameters(big)
  assert small_n == 137_216 and big_n >= 4 * small_n  # the make-run LM, and >= 4x

  def out(steps):  # a results.json's shape: per method, per seed its held-out readings
    def trial(n):  # the loss falls by 1 every 100 steps from 3 at step 0; the target is 2
      reads = [] if n is None else list(range(0, n + 20, 20))
      return {"setting": 0, "evals": {"step": reads, "heldout_loss": [
          3.0 - s / (n or 1) for s in reads] if n else [3.0]}}
    return {"target_loss": 2.0, "methods": [
        {"method": m, "trials": [trial(n) for n in s]} for m, s in steps.items()]}

  # Each trial crosses the target at exactly its n steps (interpolated between readings).
  small = out({"dp": [100, 110, 120], "diloco": [60, 70, 80], "powersgd": [150, 160, None]})
  large = out({"dp": [200, 220, 240], "diloco": [300, 330, 360], "powersgd": [180, 200, 220]})
  assert transfer.steps_to_target(small)["diloco"] == pytest.approx(70)
  t = transfer.summary(small, large, "dp", (small_n, big_n))
  assert t["methods"]["diloco"] == pytest.approx({"small": 70 / 110, "large": 1.5,
                                                  "rank_small": 1, "rank_large": 3})
  assert t["methods"]["powersgd"]["small"] == pytest.approx(160 / 110)  # a miss as infinity
  assert [line.split(":")[0] for line in t["rank_changes"]] == ["diloco", "powersgd"]
  assert "## Transfer across proxy sizes" in transfer.markdown(t)


@pytest.mark.slow
def test_with_nothing_failing_the_second_score_is_the_first(run):
  """`--failures` with devices that never fail: each method's times under failures are its
  failure-free per-seed times (each once per draw), goodput 1, the verdicts the first
  score's; the seconds per step are the trial's clock over its steps, the semantics its
  module's (DP restarts from a checkpoint; DiLoCo's 2 sites are its elastic units)."""
  config, out, saved, md = run
  found = saved["failures"]
  assert found["devices"] == 8 and found["draws"] == config.compare.failure_draws == 5
  kinds = {m: per["wan"]["semantics"] for m, per in found["summary"].items()}
  assert kinds == {"dp_bf16": "restart", "dp": "restart", "diloco": "elastic"}
  assert found["summary"]["diloco"]["wan"]["units"] == 2
  for r in saved["methods"]:
    for link in ("wan", "infiniband"):
      under, first = found["summary"][r["method"]][link], r["links"][link]
      times = [np.inf if t is None else t for t in first["study_times"]]
      assert under["times"] == pytest.approx(np.repeat(times, 5).tolist())
      assert under["verdict"] == first["verdict"]
      assert under["goodput"] in (1.0, None)
      known = r["trials"][0]["links"][link]["time"]
      assert under["step_seconds"] == pytest.approx(known[-1] / len(known))
  assert "## Under failures: custom" in md and "Under failures" in out["text"]
