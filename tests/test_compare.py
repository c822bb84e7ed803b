"""experiments/compare.py end to end with tiny settings: table, JSON, plots, bad input."""

import copy
import json
import os

import matplotlib.image
import numpy as np
import pytest

from experiments import compare
from jaxcomm import comm

TINY = compare.Settings(steps=6, batch_size=16, seq_len=16, d_model=16, num_layers=1,
                        num_heads=2, d_ff=32, smooth=2, compute_repeats=2)


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("compare"))
  return workdir, compare.run(TINY, workdir, ["dp", "dp_bf16"], verbose=True)


def test_writes_table_json_and_plots(summary):
  workdir, result = summary
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    saved = json.load(f)
  assert saved["table"] == result["table"]
  assert [m["method"] for m in saved["methods"]] == ["dp", "dp_bf16"]
  assert "final loss" in result["table"] and "dp_bf16" in result["table"]
  for name in ("loss_vs_time.png", "loss_vs_bytes.png"):
    image = matplotlib.image.imread(os.path.join(workdir, name))
    assert image.ndim == 3 and image.shape[0] > 100 and image.std() > 0


def test_numbers_come_from_the_run(summary):
  _, result = summary
  dp, bf16 = result["methods"]
  # DP's counted bytes: the ring all-reduce of every parameter, as compiled.
  assert dp["wire_bytes_per_step"] == dp["dp_wire_bytes_per_step"] == \
      dp["inspected_wire_bytes"]["every_step"]
  assert dp["compression_ratio"] == 1.0
  assert bf16["wire_bytes_per_step"] == bf16["inspected_wire_bytes"]["every_step"]
  assert 1.9 < bf16["compression_ratio"] <= 2.0  # bf16 halves it (plus padding to W chunks)
  for m in (dp, bf16):
    assert len(m["curve"]["loss"]) == TINY.steps and np.all(np.isfinite(m["curve"]["loss"]))
    assert m["final_loss"] == pytest.approx(np.mean(m["curve"]["loss"][-TINY.smooth:]))
    for network, net in m["networks"].items():
      times = np.array(net["time"])
      assert np.all(np.diff(times) > 0) and net["total_seconds"] == times[-1]
      # Synchronous methods: every step is compute + its communication on that network.
      per_step = m["compute_seconds_per_step"] + net["comm_seconds_per_step"]
      assert net["total_seconds"] == pytest.approx(TINY.steps * per_step)
      assert network in ("wan", "infiniband")
  # The target is DP's own smoothed loss, so DP reaches it, within its run.
  assert dp["networks"]["wan"]["time_to_target"] is not None
  assert dp["networks"]["wan"]["time_to_target"] <= dp["networks"]["wan"]["total_seconds"]
  # The WAN is slower than InfiniBand for the same run.
  assert dp["networks"]["wan"]["total_seconds"] > dp["networks"]["infiniband"]["total_seconds"]


def test_a_target_never_reached_is_reported_as_not_reached(summary):
  _, result = summary
  methods = copy.deepcopy(result["methods"])
  compare.add_time_to_target(methods, -1.0, TINY)
  assert all(net["time_to_target"] is None for m in methods for net in m["networks"].values())
  assert compare.table(methods, TINY, -1.0).count("not reached") == 2 * len(TINY.networks)


def test_bad_input():
  with pytest.raises(ValueError, match="steps"):
    compare.Settings(steps=0)
  with pytest.raises(ValueError, match="target_fraction"):
    compare.Settings(target_fraction=1.5)
  with pytest.raises(ValueError, match="methods"):
    compare.resolve_methods(["carrier_pigeon"])
  with pytest.raises(ValueError, match="carrier_pigeon"):
    compare.run(compare.Settings(networks=("carrier_pigeon",)), "/nonexistent", ["dp"])
  assert comm.preset("wan")  # the presets compare.py defaults to exist
