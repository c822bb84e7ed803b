"""One vocabulary for error memories: every `memory=` takes the same names and the same
`sync.ErrorMemory` records (`sync.resolve_memory`), and a record means the same thing in
every stage that accepts it (ZeRO's LoCo against numpy: tests/test_zero.py)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, local, parallel, sync

W = 8
# A memory of one's own with one buffer (EF that keeps half of its error) and one with two.
HALF = sync.ErrorMemory(init=jnp.zeros, send=lambda m, x: x + m,
                        keep=lambda m, sent, own: 0.5 * (sent - own))
TWO_BUFFERS = sync.ErrorMemory(
    init=lambda n: {"e": jnp.zeros(n), "own": jnp.zeros(n, jnp.bfloat16)},
    send=lambda m, x: x + m["e"], keep=lambda m, sent, own: {"e": sent - own, "own": own})
MEMORIES = {"none": None, "ef": "ef", "ef21": "ef21", "loco": "loco",
            "error_feedback()": sync.error_feedback(), "ef21()": sync.ef21(),
            "loco(0.5, f32)": sync.loco(0.5, jnp.float32), "half": HALF,
            "two_buffers": TWO_BUFFERS}

# Every public factory with a `memory` argument, built on one device with a codec.
STAGES = {
    "sync.compressed": lambda memory: sync.compressed(codecs.top_k(0.5), memory=memory,
                                                      axis_name=None),
    "sync.powersgd": lambda memory: sync.powersgd(1, memory=memory, axis_name=None),
    "sync.lq_sgd": lambda memory: sync.lq_sgd(1, memory=memory, axis_name=None),
    "local.diloco": lambda memory: local.diloco(optax.sgd(0.1), optax.sgd(1.0), 2, None,
                                                codec=codecs.top_k(0.5), memory=memory),
    "local.muloco": lambda memory: local.muloco(0.1, 2, None, bits=4, memory=memory),
    "parallel.zero": lambda memory: parallel.zero(optax.sgd(0.1), 1, None, codecs.top_k(0.5),
                                                  memory),
}
# What a stage cannot keep, and why: EF21's running mean (none but sync.compressed keeps
# one); several buffers per worker (DiLoCo masks one buffer of dropped workers).
REFUSED = {"sync.compressed": set(), "sync.powersgd": {"ef21", "ef21()"},
           "sync.lq_sgd": {"ef21", "ef21()"}, "parallel.zero": {"ef21", "ef21()"},
           "local.diloco": {"ef21", "ef21()", "two_buffers"},
           "local.muloco": {"ef21", "ef21()", "two_buffers"}}


def test_every_factory_with_a_memory_is_in_the_table():
  found = {f"{prefix}.{name}" for prefix, module in
           (("sync", sync), ("local", local), ("parallel", parallel))
           for name in module.__all__ if inspect.isfunction(getattr(module, name))
           and "memory" in inspect.signature(getattr(module, name)).parameters}
  assert found - {"sync.resolve_memory"} == set(STAGES) == set(REFUSED)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_memory_argument_takes_the_same_names_and_records(stage):
  params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
  for name, memory in MEMORIES.items():
    if name in REFUSED[stage]:
      with pytest.raises(ValueError, match=r"memory must be None, a sync\.ErrorMemory \(.*\) or "
                                           r"one of 'ef', 'loco' for .*; got .* \(it"):
        STAGES[stage](memory)
    else:
      jax.eval_shape(STAGES[stage](memory).init, params)  # builds and initialises
  for junk in ("ef14", True, 3, sync.ErrorMemory(None, None, None)):
    with pytest.raises(ValueError, match=r"memory must be None, a sync\.ErrorMemory.* or one "
                                         r"of 'ef', .*'loco'.*; got"):
      STAGES[stage](junk)


def test_resolved_records_see_float32_and_keep_their_dtypes():
  loco = sync.resolve_memory("loco", beta=0.5)  # bfloat16 buffers by default
  e = loco.init(2)
  assert e.dtype == jnp.bfloat16
  seen = []
  spy = sync.ErrorMemory(init=e.__class__, send=lambda m, x: seen.append(m.dtype) or x,
                         keep=lambda m, sent, own: seen.append(m.dtype) or sent - own)
  spy = sync.resolve_memory(spy)
  spy.send(e, jnp.ones(2))
  assert spy.keep(e, jnp.ones(2), jnp.zeros(2)).dtype == jnp.bfloat16
  assert seen == [jnp.float32, jnp.float32]
  kept = loco.keep(jnp.array([2.0, -2.0], jnp.bfloat16), jnp.array([1.0, 1.0]),
                   jnp.array([0.0, 3.0]))
  assert kept.dtype == jnp.bfloat16 and kept.tolist() == [1.5, -2.0]  # 0.5 e + 0.5 (s - o)


# ------------------------------------------------------------------ the same record, same meaning
def _on_workers(mesh, tx, memory_of, steps=2):
  """Every worker's parameters and memory (`memory_of(state)`) after `steps` updates, each
  worker with its own gradient."""
  params = {"w": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6), "b": jnp.linspace(0.5, -0.5, 6)}

  def body(p, i):
    state = tx.init(p)
    for t in range(steps):
      g = jax.tree.map(lambda x: jnp.sin(3.0 * x + i[0] + t), comm.varying(p, "data"))
      u, state = tx.update(g, state, p)
      p = optax.apply_updates(p, u)
    return jax.tree.map(lambda x: comm.varying(x, "data")[None], (p, memory_of(state)))

  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))
  return run(params, jnp.arange(W, dtype=jnp.float32))


@pytest.mark.parametrize("memory", ["loco", HALF], ids=["loco", "half"])
def test_diloco_h1_with_a_memory_is_compressed_sgd_with_it(mesh8, memory):
  """DiLoCo with H = 1, inner SGD(1) and outer SGD(1) sends δ_w = θ − (θ − g_w) = g_w (up to
  rounding) through its codec and memory: `sync.compressed` with the same memory, then
  SGD(1). The same record (bfloat16 LoCo, or a memory of one's own) keeps the same buffers
  and makes the same steps."""
  codec = codecs.top_k(0.25)
  got, got_memory = _on_workers(
      mesh8, local.diloco(optax.sgd(1.0), optax.sgd(1.0), 1, "data", codec=codec,
                          memory=memory), lambda s: s.memory)
  want, want_memory = _on_workers(
      mesh8, optax.chain(sync.compressed(codec, memory=memory, collective="gather"),
                         optax.sgd(1.0)), lambda s: s[0].memory)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert np.abs(np.asarray(b) - np.asarray(b)[:1]).max() == 0  # every worker agrees
  assert got_memory.dtype == want_memory.dtype == (jnp.bfloat16 if memory == "loco" else
                                                   jnp.float32)
  np.testing.assert_allclose(np.asarray(got_memory, np.float32),
                             np.asarray(want_memory, np.float32), atol=1e-2 if memory == "loco"
                             else 1e-5)
  assert np.abs(np.asarray(want_memory, np.float32)).max() > 0.1  # it really kept something


def _orthonormal(p):
  q, r = np.linalg.qr(p)
  return q * np.sign(np.diag(r))


def test_powersgd_keeps_a_loco_memory_by_the_numpy_power_iteration():
  """One device, rank 1, LoCo (beta 0.5, float32): M = g + e; P^ = orth(M Q); Q' = M^T P^;
  the output is P^ Q'^T and e <- 0.5 e + 0.5 (M - P^ Q'^T); Q is warm-started with Q'."""
  tx = sync.powersgd(1, min_compression_rate=0, memory=sync.loco(0.5, jnp.float32),
                     axis_name=None)
  rng = np.random.default_rng(0)
  params = {"w": jnp.zeros((5, 8))}
  state = tx.init(params)
  q, e = np.asarray(state.q[0][0], np.float64), np.zeros((5, 8))
  update = jax.jit(tx.update)
  for _ in range(3):
    g = rng.normal(size=(5, 8)).astype(np.float32)
    out, state = update({"w": jnp.asarray(g)}, state)
    m = g + e
    p_hat = _orthonormal(m @ q)
    q = m.T @ p_hat
    own = p_hat @ q.T
    e = 0.5 * e + 0.5 * (m - own)
    np.testing.assert_allclose(out["w"], own, atol=1e-5)
    np.testing.assert_allclose(state.error[0][0], e, atol=1e-5)
  assert np.abs(e).max() > 0.1  # rank 1 of a 5 x 8 matrix drops something
