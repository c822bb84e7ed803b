"""Compressed collectives on 8 devices: values against references, bytes three ways.

The byte formula here is written from docs/algorithms.md on the bytes of the payload the
codec really produces (read from its traced shapes), independently of the library's
`comm.compressed_bytes`, which is held against it.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, testing

W, N = 8, 1003  # odd length: the two-phase padding travels and is counted
ZOO = testing.codec_zoo()


def _psum_ok(c):
  return c.linear and "float32" in str(jax.eval_shape(
      c.encode, jax.ShapeDtypeStruct((16,), jnp.float32), jax.random.key(0))[0].dtype)


def _traced_payload_bytes(codec, m):
  """Bytes of the arrays `codec.encode` returns for m float32 elements (shapes x itemsize)."""
  payload = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct((m,), jnp.float32),
                           jax.random.key(0))
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(payload))


def _formula(codec, n, collective):
  """docs/algorithms.md: psum 2(W-1)/W P(n), gather (W-1) P(n), two-phase 2(W-1) P(ceil(n/W))."""
  if collective == "psum":
    return 2 * (W - 1) / W * _traced_payload_bytes(codec, n)
  if collective == "gather":
    return (W - 1) * _traced_payload_bytes(codec, n)
  return 2 * (W - 1) * _traced_payload_bytes(codec, -(-n // W))


CASES = [(name, coll) for name, c in ZOO.items()
         for coll in (("psum",) if _psum_ok(c) else ()) + ("gather", "two_phase")]


@pytest.fixture(scope="module")
def xs():
  return jax.random.normal(jax.random.key(5), (W, N)) * 3.0


@functools.lru_cache(maxsize=None)
def _compiled(mesh, name, collective, server_memory=False):
  """Compiled shard_map of compressed_sum; returns (compiled, recorded bytes, report)."""
  codec = ZOO[name] if isinstance(name, str) else name
  record = {}

  def body(xb, mem):
    key = jax.random.key(11)
    if codec.stochastic and not codec.shared_key:
      key = jax.random.fold_in(key, lax.axis_index("data"))
    out, nbytes = comm.compressed_sum(xb[0], codec, "data", collective,
                                      key=key if codec.stochastic else None,
                                      server_memory=mem[0] if server_memory else None)
    record["bytes"] = nbytes
    mem_out = out.server_memory if server_memory else mem[0]
    return out.total[None], comm.varying(out.own, "data")[None], comm.varying(mem_out, "data")[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                            out_specs=(P(), P("data"), P("data"))))
  spec = jax.ShapeDtypeStruct((W, N), jnp.float32)
  compiled = f.lower(spec, spec).compile()
  return compiled, record["bytes"], comm.parse_hlo(compiled.as_text(), mesh=mesh)


@pytest.mark.parametrize("name,collective", CASES)
def test_bytes_counted_equal_inspect_and_formula(mesh8, xs, name, collective):
  codec = ZOO[name]
  compiled, counted, report = _compiled(mesh8, name, collective)
  formula = _formula(codec, N, collective)
  assert counted == formula == report.wire_bytes(), report.table()
  assert comm.compressed_bytes(codec, N, W, collective) == formula  # the public helper
  assert {c.axes for c in report} == {("data",)}
  expected_ops = {"psum": {"all-reduce"}, "gather": {"all-gather"},
                  "two_phase": {"all-to-all", "all-gather"}}[collective]
  assert {c.op for c in report} == expected_ops
  if collective != "psum":  # every payload leaf travels in one packed buffer per phase
    assert sorted(c.op for c in report) == sorted(expected_ops), report.table()
  # Nothing narrower than the payload's own words travels widened: no f32 all-reduce of codes.
  if collective != "psum":
    assert all(not c.dtype.startswith("f") for c in report), report.table()
  total, own, _ = compiled(xs, jnp.zeros_like(xs))
  if collective != "two_phase":  # every device decodes every payload: the sum of what was sent
    np.testing.assert_allclose(total[0], np.sum(own, axis=0), rtol=1e-5,
                               atol=1e-5 * float(np.abs(own).max()))


def test_own_payload_is_the_single_device_round_trip(mesh8, xs):
  for name in ("uniform(4, block=64, asymmetric)", "top_k(k=4, chunk=64)",
               "dct_top_k(chunk=64, k=8)"):
    compiled, _, _ = _compiled(mesh8, name, "gather")
    _, own, _ = compiled(xs, jnp.zeros_like(xs))
    ref = jax.jit(jax.vmap(lambda x, c=ZOO[name]: c.roundtrip(x)))(xs)
    np.testing.assert_allclose(own, ref, rtol=1e-6, atol=1e-6)


def test_two_phase_exact_codecs_equal_psum(mesh8, xs):
  for name in ("identity", "cast(float32)"):
    total_psum = _compiled(mesh8, name, "psum")[0](xs, jnp.zeros_like(xs))[0]
    total_two = _compiled(mesh8, name, "two_phase")[0](xs, jnp.zeros_like(xs))[0]
    np.testing.assert_allclose(total_two, total_psum, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(total_two[0], xs.sum(0), rtol=1e-5, atol=1e-5)


def test_two_phase_matches_its_definition_with_server_memory(mesh8, xs):
  """Chunk r: s_r = sum_w D(C(x_w,r)) + m_r on device r; all get D(C(s_r));
  m_r' = s_r - D(C(s_r)).
  """
  name = "uniform(4, block=64, asymmetric)"
  codec = ZOO[name]
  compiled, counted, report = _compiled(mesh8, name, "two_phase", server_memory=True)
  assert counted == report.wire_bytes() == _formula(codec, N, "two_phase")
  mem = jax.random.normal(jax.random.key(9), (W, N)) * 0.1
  total, own, new_mem = compiled(xs, mem)
  c = -(-N // W)
  pad = lambda v: np.pad(np.asarray(v), (0, W * c - N)).reshape(W, c)
  rt = jax.jit(codec.roundtrip)
  chunks = np.stack([pad(x) for x in xs])  # [worker, chunk, c]
  # Slots of chunks a device does not own are left as they were.
  want_total, want_mem = [], np.stack([np.pad(np.asarray(m), (0, W * c - N)) for m in mem])
  for r in range(W):
    s = sum(np.asarray(rt(jnp.asarray(chunks[w, r]))) for w in range(W)) + pad(mem[r])[r]
    d = np.asarray(rt(jnp.asarray(s, jnp.float32)))
    want_total.append(d)
    want_mem[r, r * c:(r + 1) * c] = s - d
  np.testing.assert_allclose(total[0], np.concatenate(want_total)[:N], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(new_mem, want_mem[:, :N], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(own, np.stack([np.concatenate(
      [np.asarray(rt(jnp.asarray(ch))) for ch in chunks[w]])[:N] for w in range(W)]),
                             rtol=1e-5, atol=1e-5)


def test_random_k_shared_key_psum_equals_mean_of_masked(mesh8, xs):
  name = "random_k(0.1, shared)"
  total, own, _ = _compiled(mesh8, name, "psum")[0](xs, jnp.zeros_like(xs))
  mask = np.asarray(own[0]) != 0
  assert mask.sum() == round(0.1 * N)
  for w in range(W):  # every worker drew the same coordinates
    np.testing.assert_array_equal(np.asarray(own[w]) != 0, mask)
  np.testing.assert_allclose(total[0] / W, np.mean(np.where(mask, xs, 0.0), axis=0), atol=1e-6)


def test_linear_sum_refuses_narrow_floats(mesh8):
  codec = codecs.cast("bfloat16")
  f = jax.shard_map(lambda x: comm.linear_sum(codec.encode(x, None), lambda p: p[0], "data")[0],
                    mesh=mesh8, in_specs=P("data"), out_specs=P())
  with pytest.raises(ValueError, match="two_phase"):
    jax.eval_shape(f, jax.ShapeDtypeStruct((W * 4,), jnp.float32))
  with pytest.raises(ValueError, match="collective"):
    comm.compressed_bytes(codec, 10, W, "allreduce")


def test_no_axis_is_the_round_trip():
  x = jnp.linspace(-1.0, 1.0, 50)
  codec = codecs.sign(block=10)
  for coll in ("gather", "two_phase"):
    record = {}

    def run(x, coll=coll, record=record):
      out, record["bytes"] = comm.compressed_sum(x, codec, None, coll)
      return out.total

    total = jax.jit(run)(x)
    assert record["bytes"] == 0.0
    np.testing.assert_allclose(total, jax.jit(codec.roundtrip)(x))


def test_gather_weights_scale_each_devices_decoded_payload(mesh8, xs):
  # Reference: sum_w weights[w] * D(C(x_w)), each worker's round trip on one device.
  codec = ZOO["top_k(k=4, chunk=64)"]
  weights = jnp.asarray([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.5])

  def body(xb):
    out, nbytes = comm.compressed_sum(xb[0], codec, "data", "gather", weights=weights)
    return out.total[None], nbytes

  total = jax.jit(jax.shard_map(lambda xb: body(xb)[0], mesh=mesh8, in_specs=P("data"),
                                out_specs=P()))(xs)
  want = sum(float(weights[w]) * np.asarray(codec.roundtrip(xs[w])) for w in range(W))
  np.testing.assert_allclose(total[0], want, rtol=1e-5, atol=1e-5)
  # Without an axis the one weight applies.
  x = xs[0]
  total, nbytes = comm.gather_sum(codec.encode(x, None), lambda p: codec.decode(p, N), None,
                                  weights=jnp.asarray([0.5]))
  assert nbytes == 0.0
  np.testing.assert_allclose(total, 0.5 * np.asarray(codec.roundtrip(x)), rtol=1e-6)
  with pytest.raises(ValueError, match="gather"):
    comm.compressed_sum(x, codec, None, "two_phase", weights=weights)
