"""Collectives: values against numpy, wire bytes against hand literals and compiled HLO.

The byte convention (docs/algorithms.md, "The byte convention") rests on the literals here:
every collective kind's wire bytes are worked out by hand from the operand shapes (the
derivation is in the comment beside each literal) and held against the bytes the function
returns, against `comm.inspect`'s reading of the compiled program, and against the public
helpers (`allreduce_bytes`, ...). `comm.inspect` converts operand bytes into wire bytes with
the same per-op helpers as the counters, so elsewhere counted == inspected proves operand
shapes and trip counts; the convention itself is proved only here.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm import comm

W = 8


def _run(mesh, fn, x, out_specs=P()):
  record = {}

  def body(xb):
    out, nbytes = fn(xb)
    record["bytes"] = nbytes
    return out

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=out_specs))
  return f, f(x), record


def test_mean_and_sum_values_and_bytes(mesh8):
  x = jnp.arange(W * 6, dtype=jnp.float32).reshape(W, 6)
  f, out, rec = _run(mesh8, lambda b: comm.mean(b, "data"), x)
  np.testing.assert_allclose(out, x.mean(0, keepdims=True), rtol=1e-6)
  assert rec["bytes"] == 42.0  # all-reduce of f32[6] = 24 bytes: 2 * 7/8 * 24
  report = comm.inspect(f, x, mesh=mesh8)
  assert report.wire_bytes() == rec["bytes"]
  (c,) = report.collectives
  assert (c.op, c.axes, c.group_size, c.dtype) == ("all-reduce", ("data",), W, "f32")
  f, out, rec = _run(mesh8, lambda b: comm.sum(b, "data", dtype=jnp.bfloat16), x)
  np.testing.assert_allclose(out, x.sum(0, keepdims=True), rtol=1e-2)
  # Two-phase in bf16: 6 values padded to 8 = W chunks of 1, all-to-all 7/8 * 8 * 2 bytes
  # plus all-gather 7 * 1 * 2 bytes: 14 + 14.
  assert rec["bytes"] == 28.0
  report = comm.inspect(f, x, mesh=mesh8)
  assert report.wire_bytes() == rec["bytes"] and {c.dtype for c in report} == {"u16"}


def test_gather_scatter_alltoall_permute(mesh8):
  x = jnp.arange(W * W * 2, dtype=jnp.float32).reshape(W * W, 2)
  # all_gather: every device gets everything.
  f, out, rec = _run(mesh8, lambda b: comm.all_gather(b, "data", tiled=True), x)
  np.testing.assert_array_equal(out, x)
  # Each device holds f32[8, 2] = 64 bytes and receives the 7 other blocks: 7 * 64.
  assert rec["bytes"] == 448.0 == comm.inspect(f, x, mesh=mesh8).wire_bytes()
  # reduce_scatter: device r gets the r-th slice of the sum.
  f, out, rec = _run(mesh8, lambda b: comm.reduce_scatter(b, "data"), x, P("data"))
  np.testing.assert_allclose(out, x.reshape(W, W, 2).sum(0), rtol=1e-6)
  assert rec["bytes"] == 56.0 == comm.inspect(f, x, mesh=mesh8).wire_bytes()  # 7/8 * 64
  # all_to_all: a transpose of blocks.
  f, out, rec = _run(mesh8, lambda b: comm.all_to_all(b, "data"), x, P("data"))
  np.testing.assert_array_equal(out, x.reshape(W, W, 2).transpose(1, 0, 2).reshape(W * W, 2))
  assert rec["bytes"] == 56.0 == comm.inspect(f, x, mesh=mesh8).wire_bytes()  # 7/8 * 64
  # ppermute ring: device i receives from i - 1.
  f, out, rec = _run(mesh8, lambda b: comm.shift(b, "data", 1), x, P("data"))
  np.testing.assert_array_equal(out, jnp.roll(x.reshape(W, W, 2), 1, axis=0).reshape(-1, 2))
  assert rec["bytes"] == 64.0 == comm.inspect(f, x, mesh=mesh8).wire_bytes()  # one block, once


def test_no_axis_means_one_device():
  x = {"a": jnp.ones(3)}
  for fn in (comm.mean, comm.sum, comm.reduce_scatter, comm.all_to_all):
    out, nbytes = fn(x, None)
    assert nbytes == 0 and out is x
  out, nbytes = comm.all_gather(x, None)
  assert nbytes == 0 and out["a"].shape == (1, 3)


def test_inspect_maps_groups_to_axes_on_2d_mesh(mesh4x2):
  def body(x):
    a = lax.psum(x, "data")
    b = lax.psum(x, "tensor")
    c = lax.all_gather(x, "data", tiled=True)
    d = lax.psum_scatter(x, "tensor", tiled=True)
    e = lax.all_to_all(x, "data", 0, 0, tiled=True)
    g = lax.ppermute(x, "tensor", [(0, 1), (1, 0)])
    h = lax.psum(x, ("data", "tensor"))
    return (a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + g.sum() + h.sum())[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh4x2, in_specs=P("data", "tensor"),
                            out_specs=P(("data", "tensor"))))
  x = jnp.arange(32 * 8, dtype=jnp.float32).reshape(32, 8) + 1.0
  report = comm.inspect(f, x, mesh=mesh4x2)
  got = sorted((c.op, c.axes) for c in report)
  assert got == sorted([
      ("all-reduce", ("data",)), ("all-reduce", ("tensor",)), ("all-gather", ("data",)),
      ("reduce-scatter", ("tensor",)), ("all-to-all", ("data",)),
      ("collective-permute", ("tensor",)), ("all-reduce", ("data", "tensor"))])
  # Every operand is this device's f32[8, 4] = 128 bytes; W = 4 on data, 2 on tensor.
  by_op = {(c.op, c.axes): c.wire_bytes for c in report}
  assert by_op[("all-reduce", ("data",))] == 192.0            # 2 * 3/4 * 128
  assert by_op[("all-gather", ("data",))] == 384.0            # 3 * 128
  assert by_op[("reduce-scatter", ("tensor",))] == 64.0       # 1/2 * 128
  assert by_op[("all-to-all", ("data",))] == 96.0             # 3/4 * 128
  assert by_op[("collective-permute", ("tensor",))] == 128.0  # one buffer to one peer
  assert by_op[("all-reduce", ("data", "tensor"))] == 224.0   # 2 * 7/8 * 128
  assert "all-gather" in report.table()


def test_inspect_marks_conditional_and_loops(mesh8):
  def body(x, pred):
    x = lax.cond(pred[0], lambda v: comm.varying(lax.psum(v, "data"), "data"), lambda v: v, x)
    perm = [(i, (i + 1) % W) for i in range(W)]
    return lax.fori_loop(0, 5, lambda i, v: lax.ppermute(v, "data", perm) * 0.5, x)

  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=(P("data"), P()), out_specs=P("data")))
  report = comm.inspect(f, jnp.ones(W * 4), jnp.array([True]), mesh=mesh8)
  (ar,) = report.select(op="all-reduce")
  assert ar.in_conditional and ar.trips == 1 and ar.branch
  (cp,) = report.select(op="collective-permute")
  assert not cp.in_conditional and cp.trips == 5 and cp.branch == ""
  assert report.wire_bytes(conditional=False) == 80.0  # 5 trips of f32[4] = 16 bytes


def test_inspect_tells_conditional_branches_apart(mesh8):
  # Two branches of one switch and a second conditional: three branches, each collective
  # in its own (jaxcomm.plan unwraps byte counters past 4 GiB by them).
  def body(x, i):
    x = lax.switch(i[0], [lambda v: comm.varying(lax.psum(v, "data"), "data"),
                          lambda v: comm.varying(lax.psum(2 * v[:2], "data"), "data").sum()
                          * v, lambda v: v], x)
    return lax.cond(i[0] > 0, lambda v: comm.varying(lax.pmax(v, "data"), "data"),
                    lambda v: v, x)

  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=(P("data"), P()), out_specs=P("data")))
  report = comm.inspect(f, jnp.ones(W * 4), jnp.array([1]), mesh=mesh8)
  branches = {c.branch for c in report}
  assert len(report) == 3 and len(branches) == 3 and "" not in branches


def test_iota_replica_groups():
  from jaxcomm.comm._inspect import _iota_groups
  assert _iota_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert _iota_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_counter_is_modular_and_found_by_name():
  from typing import NamedTuple

  class S(NamedTuple):
    wire_bytes: jax.Array
    other: jax.Array

  c = comm.add_bytes(comm.zero_bytes(), 2**32 - 10)
  d = comm.add_bytes(c, 25)
  assert int(d - c) == 25  # exact across the wrap-around
  state = (S(comm.add_bytes(comm.zero_bytes(), 7), jnp.ones(3)),
           {"x": S(comm.add_bytes(comm.zero_bytes(), 5), jnp.zeros(()))})
  assert int(comm.counted_bytes(state)) == 12


def test_public_byte_helpers_equal_hand_literals():
  """The helpers every counter (and `comm.inspect`) uses, and `compressed_bytes`, against
  values worked out by hand from docs/algorithms.md."""
  from jaxcomm import codecs
  assert comm.allreduce_bytes(1000, 8) == 1750.0      # 2 * 7/8 * 1000
  assert comm.reduce_scatter_bytes(1000, 8) == 875.0  # 7/8 * 1000
  assert comm.all_gather_bytes(100, 8) == 700.0       # 7 * 100
  assert comm.all_to_all_bytes(1000, 8) == 875.0      # 7/8 * 1000
  assert comm.allreduce_bytes(1000, 1) == 0.0         # nobody to talk to
  assert comm.tree_bytes({"w": jnp.ones((3, 4)), "b": jnp.ones(4, jnp.bfloat16)}) == 56  # 48 + 8
  cases = [
      # identity on 1000 elements: psum of 4000 bytes, 2 * 7/8 * 4000.
      (codecs.identity(), 1000, "psum", 7000.0),
      # top-4 of each of ceil(1003 / 64) = 16 chunks: 64 (f32 value, u8 index) pairs = 320
      # bytes, all-gathered: 7 * 320.
      (codecs.top_k(k=4, chunk=64), 1003, "gather", 2240.0),
      # two-phase: chunks of ceil(1003 / 8) = 126; sign bits ceil(126 / 8) = 16 bytes and one
      # f32 scale (126 <= 128): 20 bytes, sent 7 times in each phase: 2 * 7 * 20.
      (codecs.sign(block=128), 1003, "two_phase", 280.0),
      # 4-bit codes of 126 elements = 63 bytes, two blocks of 64 with (lo, step) f32 = 16:
      # 79 bytes per chunk payload, 2 * 7 * 79.
      (codecs.uniform(4, block=64, symmetric=False), 1003, "two_phase", 1106.0),
  ]
  for codec, n, collective, want in cases:
    assert comm.compressed_bytes(codec, n, W, collective) == want, codec.name
