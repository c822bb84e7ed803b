"""The alpha-beta cost model: closed forms, scaling, compiled programs, bad input."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm import comm

A, BW = 2e-5, 5e8  # alpha (s) and bandwidth (B/s) of the test link
LINK = comm.Link(BW, A)


def _closed_form(op, alg, n, p):
  """The formulas of Thakur et al. (2005), written out case by case."""
  a, b, lg = A, 1 / BW, math.ceil(math.log2(p))
  table = {
      ("all-reduce", "ring"): 2 * (p - 1) * a + 2 * (p - 1) / p * n * b,
      ("all-reduce", "tree"): lg * a + lg * n * b,
      ("all-reduce", "halving_doubling"): 2 * lg * a + 2 * (p - 1) / p * n * b,
      ("all-gather", "ring"): (p - 1) * a + (p - 1) * n * b,
      ("all-gather", "tree"): lg * a + (p - 1) * n * b,
      ("all-gather", "halving_doubling"): lg * a + (p - 1) * n * b,
      ("reduce-scatter", "ring"): (p - 1) * a + (p - 1) / p * n * b,
      ("reduce-scatter", "tree"): lg * a + (p - 1) / p * n * b,
      ("reduce-scatter", "halving_doubling"): lg * a + (p - 1) / p * n * b,
      ("all-to-all", "ring"): (p - 1) * a + (p - 1) / p * n * b,
      ("all-to-all", "tree"): lg * a + lg * n / 2 * b,
      ("all-to-all", "halving_doubling"): (p - 1) * a + (p - 1) / p * n * b,
  }
  if op == "collective-permute":
    return a + n * b
  return table[(op, alg)]


@pytest.mark.parametrize("op", comm.OPS)
@pytest.mark.parametrize("alg", ["ring", "tree", "halving_doubling"])
@pytest.mark.parametrize("p", [2, 6, 8])
def test_each_collective_matches_closed_form(op, alg, p):
  for n in (0.0, 4.0, 3e6):
    expected = _closed_form(op, alg, n, p)
    if op == "collective-permute" and n == 0:
      expected = 0.0  # an empty permute sends nothing
    assert comm.collective_time(op, n, p, LINK, alg) == pytest.approx(expected, rel=1e-12)


def test_ring_bandwidth_term_is_the_wire_byte_convention():
  no_latency = comm.Link(BW, 0.0)
  n, p = 12345.0, 8
  expected = {"all-reduce": 2 * (p - 1) / p * n,  # docs/algorithms.md, "The byte convention"
              "all-gather": (p - 1) * n,
              "reduce-scatter": (p - 1) / p * n,
              "all-to-all": (p - 1) / p * n,
              "collective-permute": n}
  for op, wire in expected.items():
    assert comm.collective_time(op, n, p, no_latency, "ring") * BW == pytest.approx(wire)


def test_auto_picks_the_fastest_and_small_messages_go_by_tree():
  for n in (8.0, 1e4, 1e8):
    times = comm.algorithm_times("all-reduce", n, 8, LINK)
    assert comm.collective_time("all-reduce", n, 8, LINK) == min(times.values())
  small = comm.algorithm_times("all-reduce", 8.0, 8, LINK)
  large = comm.algorithm_times("all-reduce", 1e8, 8, LINK)
  assert min(small, key=small.get) == "tree"
  assert min(large, key=large.get) == "halving_doubling"
  assert comm.collective_time("all-reduce", 1e3, 1, LINK) == 0.0  # one device: no network


@pytest.mark.parametrize("op", comm.OPS)
def test_equal_links_time_scales_with_bytes(op):
  topo = comm.Topology({"data": LINK, "tensor": comm.Link(BW, A)})
  link = topo.link(("data", "tensor"))
  base = comm.collective_time(op, 0.0 if op != "collective-permute" else 1e-9, 8, link, "ring")
  t1 = comm.collective_time(op, 1e6, 8, link, "ring") - base
  for k in (2, 3, 10):
    tk = comm.collective_time(op, k * 1e6, 8, link, "ring") - base
    assert tk == pytest.approx(k * t1, rel=1e-6)
  # With no latency the time is proportional to the bytes.
  zero = comm.Topology.uniform(comm.Link(BW, 0.0))
  t = [comm.collective_time(op, n, 8, zero.link("data"), "ring") for n in (1e3, 7e3)]
  assert t[1] == pytest.approx(7 * t[0])


def test_multi_axis_collectives_run_at_the_slowest_link():
  topo = comm.Topology({"data": "wan", "tensor": "nvlink"})
  link = topo.link(("tensor", "data"))
  assert link.bandwidth == comm.preset("wan").bandwidth
  assert link.latency == comm.preset("wan").latency
  assert topo.link("tensor") == comm.preset("nvlink")


def test_cost_of_a_compiled_program(mesh4x2):
  def body(x):
    a = lax.psum(x, "data")
    b = lax.all_gather(x, "tensor", tiled=True)
    c = lax.psum(x, ("data", "tensor"))
    d = lax.cond(x[0] > 0, lambda: comm.varying(lax.psum(x * 2, "data"), "data"), lambda: x)
    return jnp.concatenate([a, b, c, d])

  f = jax.jit(jax.shard_map(body, mesh=mesh4x2, in_specs=P(("data", "tensor")),
                            out_specs=P(("data", "tensor"))))
  x = jnp.arange(8 * 1000, dtype=jnp.float32)
  report = comm.inspect(f, x, mesh=mesh4x2)
  topo = comm.Topology({"data": "ethernet_10g", "tensor": "nvlink"})
  costed = comm.cost(report, topo)
  assert len(costed) == len(report) >= 4
  for entry in costed:
    col = entry.collective
    link = topo.link(col.axes)
    assert entry.link == link
    assert entry.seconds == comm.collective_time(col.op, col.operand_bytes, col.group_size,
                                                 link)
    assert entry.seconds == min(comm.algorithm_times(col.op, col.operand_bytes,
                                                     col.group_size, link).values())
  assert costed.seconds() == pytest.approx(sum(c.total_seconds for c in costed))
  assert costed.seconds(conditional=True) > 0 and costed.seconds(conditional=False) > 0
  assert costed.seconds(conditional=True) + costed.seconds(conditional=False) == \
      pytest.approx(costed.seconds())
  ring = comm.cost(report, topo, "ring")
  assert ring.seconds() >= costed.seconds()
  assert "total" in costed.table()


def test_counted_bytes_give_the_same_time_as_the_compiled_collective(mesh8):
  f = jax.jit(jax.shard_map(lambda x: lax.psum(x, "data"), mesh=mesh8, in_specs=P("data"),
                            out_specs=P()))
  x = jnp.ones(8 * 5000, jnp.float32)
  report = comm.inspect(f, x, mesh=mesh8)
  wire = 35000.0  # all-reduce of f32[5000] = 20000 bytes: 2 * 7/8 * 20000
  assert report.wire_bytes() == wire
  for alg in ("ring", "tree", "halving_doubling"):
    assert comm.wire_bytes_time(wire, "wan", group_size=8, algorithm=alg) == \
        pytest.approx(comm.cost(report, "wan", alg).seconds())
  # Two collectives carrying the same bytes pay the latency twice.
  two = comm.wire_bytes_time(wire, LINK, group_size=8, messages=2, algorithm="ring")
  one = comm.wire_bytes_time(wire, LINK, group_size=8, messages=1, algorithm="ring")
  assert two - one == pytest.approx(2 * 7 * A)


def test_presets_have_numbers_and_sources():
  assert {"tpu_ici", "nvlink", "infiniband", "ethernet_100g", "ethernet_10g",
          "wan"} <= set(comm.PRESETS)
  for name, link in comm.PRESETS.items():
    assert link.bandwidth > 0 and link.latency >= 0 and link.source and link.name == name
  assert comm.preset("ethernet_10g").bandwidth == 10e9 / 8
  assert comm.preset("wan").bandwidth == 1e9 / 8 and 0.01 <= comm.preset("wan").latency <= 0.1
  assert comm.topology("infiniband").link("anything") == comm.preset("infiniband")


@pytest.mark.parametrize("make, word", [
    (lambda: comm.Link(-1.0, 1e-6), "bandwidth"),
    (lambda: comm.Link(0.0, 1e-6), "bandwidth"),
    (lambda: comm.Link(float("nan"), 1e-6), "bandwidth"),
    (lambda: comm.Link(1e9, -1e-6), "latency"),
    (lambda: comm.Link.gbit(-10, 1e-6), "gbit_per_s"),
    (lambda: comm.preset("carrier_pigeon"), "carrier_pigeon"),
    (lambda: comm.topology("carrier_pigeon"), "topology"),
    (lambda: comm.topology(3.0), "topology"),
    (lambda: comm.Topology({"data": "carrier_pigeon"}), "links['data']"),
    (lambda: comm.Topology({"data": "wan"}).link("tensor"), "tensor"),
    (lambda: comm.collective_time("broadcast", 1.0, 8, LINK), "op"),
    (lambda: comm.collective_time("all-reduce", 1.0, 8, LINK, "butterfly"), "algorithm"),
    (lambda: comm.collective_time("all-reduce", -1.0, 8, LINK), "nbytes"),
    (lambda: comm.collective_time("all-reduce", 1.0, 0, LINK), "group_size"),
    (lambda: comm.wire_bytes_time(1.0, LINK, group_size=8, messages=0), "messages"),
    (lambda: comm.cost([1, 2], LINK), "report"),
])
def test_bad_input_names_the_argument(make, word):
  with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
    make()


def test_split_operands_charges_the_latency_once_per_operand():
  col = comm.Collective(op="all-reduce", dtype="f32", shape=((10,), (30,)), axes=("data",),
                        group_size=8, operand_bytes=160.0, wire_bytes=280.0,
                        in_conditional=False, trips=1, name="tuple")
  combined = comm.cost([col], LINK, "ring").seconds()
  split = comm.cost([col], LINK, "ring", split_operands=True).seconds()
  assert combined == pytest.approx(comm.collective_time("all-reduce", 160.0, 8, LINK, "ring"))
  assert split == pytest.approx(comm.collective_time("all-reduce", 40.0, 8, LINK, "ring") +
                                comm.collective_time("all-reduce", 120.0, 8, LINK, "ring"))
  assert split - combined == pytest.approx(2 * 7 * A)  # one more ring latency schedule
