"""experiments/compare.py end to end with tiny settings: table, JSON, plots, bad input, and
the properties of its figures: counted bytes against the compiled step, compression ratios,
overlap on the simulated clock, and dp_bf16 really reducing in bfloat16."""

import copy
import json
import os

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from experiments import build
from experiments import compare
from experiments.configs import compare as compare_config
from jaxcomm import codecs
from jaxcomm import comm

TINY = compare_config.get_config()
TINY.steps = 6
TINY.data.update(batch_size=16, seq_len=16)
TINY.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
TINY.compare.update(smooth=2, compute_repeats=2)
W = 8
H = 3  # TINY's local-update period: two syncs in its 6 steps
TINY_METHODS = {
    **{label: compare.METHODS[label] for label in ("dp", "dp_bf16", "topk1%_ef", "acco")},
    # Streaming DiLoCo as compare.METHODS has it, with a period short enough for TINY.
    "streaming": {**compare.METHODS["streaming_h10"], "sync_every": H, "overlap": 1},
}


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("compare"))
  return workdir, compare.run(TINY, workdir, list(TINY_METHODS), verbose=True,
                              catalog=TINY_METHODS)


def _by_method(result):
  return {m["method"]: m for m in result["methods"]}


def test_writes_table_json_and_plots(summary):
  workdir, result = summary
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    saved = json.load(f)
  assert saved["table"] == result["table"]
  assert [m["method"] for m in saved["methods"]] == list(TINY_METHODS)
  assert "final loss" in result["table"] and "dp_bf16" in result["table"]
  for name in ("loss_vs_time.png", "loss_vs_bytes.png"):
    image = matplotlib.image.imread(os.path.join(workdir, name))
    assert image.ndim == 3 and image.shape[0] > 100 and image.std() > 0


def test_numbers_come_from_the_run(summary):
  _, result = summary
  dp, bf16 = result["methods"][:2]
  # DP's counted bytes: the ring all-reduce of every parameter, as compiled.
  assert dp["wire_bytes_per_step"] == dp["dp_wire_bytes_per_step"] == \
      dp["inspected_wire_bytes"]["every_step"]
  assert dp["compression_ratio"] == 1.0
  assert bf16["wire_bytes_per_step"] == bf16["inspected_wire_bytes"]["every_step"]
  assert 1.9 < bf16["compression_ratio"] <= 2.0  # bf16 halves it (plus padding to W chunks)
  for m in (dp, bf16):
    assert len(m["curve"]["loss"]) == TINY.steps and np.all(np.isfinite(m["curve"]["loss"]))
    assert m["final_loss"] == pytest.approx(np.mean(m["curve"]["loss"][-TINY.compare.smooth:]))
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
  assert compare.table(methods, TINY, -1.0).count("not reached") == \
      len(methods) * len(TINY.compare.networks)


def test_counted_bytes_are_the_compiled_steps(summary):
  """Bytes counted in state per step == the compiled step's collectives (comm.inspect):
  every step for synchronous and overlapped methods; for Streaming DiLoCo the compiled sync
  branch sends one fragment (chosen by the step), and each of its P fragments syncs once
  every H steps, so a step sends P/H of that branch on average."""
  _, result = summary
  for m in result["methods"]:
    every, cond = (m["inspected_wire_bytes"]["every_step"],
                   m["inspected_wire_bytes"]["conditional"])
    if m["algo"] == "streaming_diloco":
      assert every == 0 and cond > 0
      assert TINY.steps % H == 0
      fragments = TINY_METHODS["streaming"]["fragments"]
      # Counters round each sync's bytes to whole bytes.
      assert m["wire_bytes_per_step"] == pytest.approx(fragments * cond / H, abs=1.0)
    else:
      assert cond == 0
      assert m["wire_bytes_per_step"] == pytest.approx(every, abs=1.0), m["method"]


def test_compression_ratio_is_dp_bytes_over_counted_bytes(summary):
  _, result = summary
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
  _, result = summary
  by = _by_method(result)
  assert by["acco"]["overlap_steps"] == 1 and by["streaming"]["overlap_steps"] == 1
  for m in result["methods"]:
    for network, net in m["networks"].items():
      if m["overlap_steps"]:
        assert net["total_seconds"] <= net["total_seconds_without_overlap"] + 1e-12
      else:
        assert net["total_seconds"] == net["total_seconds_without_overlap"]
  # On the WAN ACCO's all-reduce takes longer than a step's compute: hiding the compute of
  # the next round behind it shortens the run.
  wan = by["acco"]["networks"]["wan"]
  assert wan["total_seconds"] < wan["total_seconds_without_overlap"]


def test_dp_bf16_changes_the_updates_but_little(summary):
  _, result = summary
  by = _by_method(result)
  dp, bf16 = (np.array(by[k]["curve"]["loss"]) for k in ("dp", "dp_bf16"))
  assert dp[0] == bf16[0]  # the same parameters and batch: the first loss is before any update
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
