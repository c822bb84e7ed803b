"""A two-level network (`comm.Sites`) and plans at scale (`plan.extrapolate`, `plan.PlanCache`).

* Sites: every collective's phases and seconds against literals derived by hand from the
  presets' alpha and beta; a per-site bandwidth shared by the site's devices, a per-device
  one not; a compiled DP step on 2 sites x 4 devices charged as reduce-scatter inside,
  all-reduce between, all-gather inside.
* Blocks: the make-run LM planned at 1 and 2 blocks and extrapolated to 3 equals its plan
  at 3 blocks (collectives, counted bytes and state exactly; FLOPs within XLA:CPU's small
  backward term, see `jaxcomm/plan/_blocks.py`).
* The plan cache reads back what it wrote, keyed by every part.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from experiments import build
from experiments import config
from experiments.configs import compare as compare_config
from jaxcomm import comm, plan

WAN = comm.preset("wan")          # 1 Gbit/s per site = 125e6 B/s, 30 ms
NVLINK = comm.preset("nvlink")    # 450e9 B/s per device, 5 us
IB = comm.preset("infiniband")    # 400 Gbit/s = 50e9 B/s per device, 5 us


def _all_reduce(n, axes, p):
  return comm.Collective("all-reduce", "f32", (n // 4,), axes, p, n, 2 * (p - 1) / p * n,
                         False, 1, "ar")


# ---------------------------------------------------------------- the cost model
def test_a_wan_link_is_per_site_and_infiniband_per_device():
  assert (WAN.per, comm.preset("internet").per) == ("site", "site")
  assert {comm.preset(n).per for n in ("infiniband", "nvlink", "ethernet_100g")} == {"device"}
  net = comm.Sites(2, 8, "wan")
  assert net.share.bandwidth == 125e6 / 8 and net.share.latency == 0.03
  assert comm.Sites(2, 8, "infiniband").share == IB  # a port per device: not divided


def test_dp_on_2_sites_x_8_by_hand():
  """A DP all-reduce of 400 MB over all 16 devices (replica x data), ring algorithm:
  reduce-scatter inside (8), all-reduce between (2) of 50 MB at 1/8 of 1 Gbit/s, all-gather
  inside (8) of 50 MB each."""
  n = 400e6
  rs = 7 * 5e-6 + 7 / 8 * n / 450e9
  ar = 2 * 0.03 + 2 * 1 / 2 * (n / 8) / (125e6 / 8)   # = 0.06 + 3.2
  ag = 7 * 5e-6 + 7 * (n / 8) / 450e9
  assert rs + ar + ag == pytest.approx(3.2616256, abs=1e-7)
  net = comm.Sites(2, 8, "wan", "nvlink")
  assert net.phases("all-reduce", n, 16, ("replica", "data")) == [
      ("reduce-scatter", n, 8, NVLINK), ("all-reduce", n / 8, 2, net.share),
      ("all-gather", n / 8, 8, NVLINK)]
  costed = comm.cost([_all_reduce(int(n), ("replica", "data"), 16)], net, "ring")
  assert costed.seconds() == pytest.approx(3.2616256, abs=1e-7)
  assert costed.costs[0].algorithm == "hierarchical (ring)"
  # "auto": the log-step algorithms where they are faster: the 2-site all-reduce in one
  # message of 50 MB (recursive doubling, 1 latency), the inner phases in 3 latencies.
  auto = comm.cost([_all_reduce(int(n), ("replica", "data"), 16)], net).seconds()
  assert auto == pytest.approx(3 * 5e-6 + 7 / 8 * n / 450e9 + 0.03 + (n / 8) / (125e6 / 8)
                               + 3 * 5e-6 + 7 * (n / 8) / 450e9, rel=1e-12)
  # The same bytes over a flat 16-device ring at the WAN's pace (comm.Topology, per device):
  # 30 latencies, and 8x the bandwidth a site's device shares.
  flat = comm.cost([_all_reduce(int(n), ("replica", "data"), 16)], WAN, "ring").seconds()
  assert flat == pytest.approx(30 * 0.03 + 2 * 15 / 16 * n / 125e6)


@pytest.mark.parametrize("op, phases", [
    ("reduce-scatter", [("reduce-scatter", 8e6, 4, "inside"), ("reduce-scatter", 2e6, 2, "x")]),
    ("all-gather", [("all-gather", 8e6, 2, "x"), ("all-gather", 16e6, 4, "inside")]),
    ("all-to-all", [("all-to-all", 8e6, 4, "inside"), ("all-to-all", 8e6, 2, "x")]),
    ("collective-permute", [("collective-permute", 8e6, 2, "x")]),
])
def test_each_collective_spanning_sites_runs_in_phases(op, phases):
  net = comm.Sites(2, 4, "internet", "nvlink")
  links = {"inside": NVLINK, "x": net.share}
  assert net.phases(op, 8e6, 8, ("replica", "fsdp")) == [
      (o, n, p, links[l]) for o, n, p, l in phases]
  seconds = sum(comm.collective_time(o, n, p, links[l], "ring") for o, n, p, l in phases)
  assert net.collective_seconds(op, 8e6, 8, ("replica", "fsdp"), "ring")[1] == \
      pytest.approx(seconds)
  # Inside a site only: the inside link, as a Topology; over sites only: the share.
  assert net.phases(op, 8e6, 4, ("fsdp",)) == [(op, 8e6, 4, NVLINK)]
  assert net.phases("all-reduce", 8e6, 2, ("replica",)) == [("all-reduce", 8e6, 2, net.share)]


def test_a_compiled_dp_step_on_2_sites_x_4(mesh8):
  mesh = jax.make_mesh((2, 4), ("replica", "data"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  grad = jnp.ones((8, 31_250), jnp.float32)  # 125,000 bytes per device
  f = jax.shard_map(lambda g: jax.lax.pmean(g, ("replica", "data")), mesh=mesh,
                    in_specs=P(("replica", "data")), out_specs=P())
  report = comm.inspect(f, grad, mesh=mesh)
  (col,) = report
  assert (col.op, col.axes, col.group_size, col.operand_bytes) == \
      ("all-reduce", ("replica", "data"), 8, 125_000)
  n = 125_000
  by_hand = (3 * 5e-6 + 3 / 4 * n / 450e9) + (2 * 0.03 + (n / 4) / (125e6 / 4)) \
      + (3 * 5e-6 + 3 * (n / 4) / 450e9)
  assert comm.cost(report, comm.Sites(2, 4, "wan"), "ring").seconds() == pytest.approx(by_hand)


@pytest.mark.parametrize("make, words", [
    (lambda: comm.Sites(0, 8, "wan"), "sites must be an integer"),
    (lambda: comm.Sites(2, 8, "lan"), "between 'lan' is not a preset"),
    (lambda: comm.Link(-1e9, 0.01), "bandwidth must be finite and > 0"),
    (lambda: comm.Link(1e9, 0.01, per="rack"), "per must be one of"),
    (lambda: comm.Sites(2, 8, "wan").phases("all-reduce", 1.0, 3, ("replica",)), "multiple"),
    (lambda: comm.Sites(2, 8, "wan").phases("all-reduce", 1.0, 2, ()), "unknown"),
])
def test_bad_networks_are_named(make, words):
  with pytest.raises(ValueError, match=words):
    make()


# ---------------------------------------------------------------- plans of a stack
STEPS = 12


@pytest.fixture(scope="module")
def stack():
  """plan_at(method entry, blocks): the make-run LM on replica=2,fsdp=4 (compiled once)."""
  done = {}

  def plan_at(entry, blocks):
    key = (repr(entry), blocks)
    if key not in done:
      c = config.with_method(compare_config.get_config(), entry)
      with c.unlocked():
        c.mesh, c.steps, c.model.num_layers = "replica=2,fsdp=4", STEPS, blocks
      run = build.build(c, abstract=True)
      done[key] = plan.compile_step(run.program(), run.params, run.batches(0), steps=STEPS)
    return done[key]
  return plan_at


def _multiset(report):
  return sorted((c.op, c.axes, c.group_size, c.operand_bytes, c.wire_bytes, c.in_conditional,
                 tuple(sorted(map(str, c.shape)))) for c in report)


@pytest.mark.slow
def test_two_small_plans_extrapolate_to_the_full_plan(stack):
  # DiLoCo on replica x fsdp: per-block gathers and reduce-scatters, collectives combined
  # over blocks (growing), its sync in a conditional, counted every 4th step.
  entry = {"method": "diloco", "sync_every": 4}
  full = stack(entry, 3)
  got = plan.extrapolate(stack(entry, 1), stack(entry, 2), 3)
  assert _multiset(got.report) == _multiset(full.report)
  assert got.report.by_axis() == full.report.by_axis()
  assert got.state_bytes == full.state_bytes
  assert full.counted is not None and full.report.wire_bytes(conditional=True) > 0
  np.testing.assert_array_equal(got.counted, full.counted)
  # XLA:CPU counts a little more in the backward pass per pair of blocks (module docstring
  # of jaxcomm/plan/_blocks.py): within 1 % here, 4e-6 of a block at llama_1b's widths.
  assert got.flops == pytest.approx(full.flops, rel=1e-2)
  assert got.memory.arguments == full.memory.arguments


def test_a_plan_that_is_not_a_stack_is_refused(stack):
  one = stack({"method": "diloco", "sync_every": 4}, 1)
  other = plan.StepPlan(comm.CollectiveReport(()), one.memory, one.flops, 0.0,
                        one.state_bytes, None, "", one.mesh_shape, one.steps)
  with pytest.raises(plan.NotAffine, match="at 1 block"):
    plan.extrapolate(one, other, 5)


def test_the_plan_cache_reads_back_what_it_wrote(stack, tmp_path):
  step = stack({"method": "diloco", "sync_every": 4}, 1)
  cache = plan.PlanCache(tmp_path)
  key = plan.plan_key(model="lm", mesh="replica=2,fsdp=4", method={"sync_every": 4})
  assert cache.get(key) is None
  cache.put(key, step)
  back = cache.get(key)
  assert back.report == step.report and back.memory == step.memory
  assert back.flops == step.flops and back.state_bytes == step.state_bytes
  np.testing.assert_array_equal(back.counted, step.counted)
  assert plan.plan_key(model="lm", mesh="replica=2,fsdp=4", method={"sync_every": 5}) != key
  assert math.isclose(back.bytes_per_step(), step.bytes_per_step())
