"""sync.compressed: exactness against sync.mean, memories, hierarchy, convergence, bytes, bad
input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, sync, testing, train
from tests import contract

W = 8
ZOO = testing.codec_zoo()
KEY = jax.random.key(0)


# ---------------------------------------------------------------------------- contract suite
@pytest.mark.parametrize("name", list(ZOO))
def test_contract_every_codec_with_error_feedback(name):
  # EF is stable for lr below about the codec's contraction (top-1 of 16 here): small lr.
  codec = ZOO[name]
  tx = optax.chain(sync.compressed(codec, memory="ef", axis_name=None, key=KEY), optax.sgd(0.02))
  testing.check_transform(tx, steps=300)


# ---------------------------------------------------------------------------- one update
N = 500


@pytest.fixture(scope="module")
def grads():
  """[steps=3, W, N] local gradients, different on every worker and step."""
  return jax.random.normal(jax.random.key(3), (3, W, N)) * jnp.linspace(0.1, 3.0, N)


def _updates(mesh, tx, grads, steps=1):
  """`steps` updates of `tx` on each worker's rows, in shard_map without the Trainer.

  Returns the updates [steps, W, N] and the final state with a leading worker axis on every
  leaf (replicated leaves repeat).
  """
  params = {"w": jnp.zeros((grads.shape[-1],))}

  def body(g):  # g: [steps, 1, N], this worker's rows
    state, out = tx.init(params), []
    for t in range(steps):
      u, state = tx.update({"w": g[t, 0]}, state, params)
      out.append(u["w"])
    stack = lambda x: comm.varying(x, "data")[None]
    return stack(jnp.stack(out)), jax.tree.map(stack, state)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "data"), out_specs=P("data")))
  updates, state = f(grads[:steps])
  return np.asarray(updates).transpose(1, 0, 2), state


def _roundtrip(codec, rows, key=None):
  return np.asarray(jax.jit(jax.vmap(lambda x: codec.roundtrip(x, key)))(rows))


def test_identity_and_cast_float32_equal_sync_mean(mesh8, grads):
  ref, _ = _updates(mesh8, sync.mean("data"), grads)
  np.testing.assert_allclose(ref[0, 0], grads[0].mean(0), rtol=1e-5, atol=1e-6)
  for codec, collective in [(codecs.identity(), None), (codecs.identity(), "gather"),
                            (codecs.cast("float32"), "two_phase")]:
    out, state = _updates(mesh8, sync.compressed(codec, collective=collective), grads)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert state.memory is None and state.key is None


def test_random_k_shared_key_psum_equals_mean_of_masked_gradients(mesh8, grads):
  codec = codecs.random_k(0.1)
  out, _ = _updates(mesh8, sync.compressed(codec, key=KEY), grads)
  # The coordinates every worker drew: the transform splits its key once per update.
  _, sub = jax.random.split(KEY)
  mask = _roundtrip(codec, jnp.ones((1, N)), sub)[0] != 0
  assert mask.sum() == round(0.1 * N)
  np.testing.assert_allclose(out[0, 0], np.where(mask, grads[0], 0.0).mean(0), atol=1e-6)


def _np_top_k(rows, k=8, chunk=64):
  """numpy reference of top_k(k, chunk): the k largest magnitudes of each chunk of a row."""
  rows = np.asarray(rows, np.float32)
  n = rows.shape[-1]
  m = -(-n // chunk)
  x = np.pad(rows, ((0, 0), (0, m * chunk - n))).reshape(len(rows), m, chunk)
  keep = np.argsort(-np.abs(x), axis=-1)[..., :k]
  out = np.zeros_like(x)
  np.put_along_axis(out, keep, np.take_along_axis(x, keep, axis=-1), axis=-1)
  return out.reshape(len(rows), -1)[:, :n]


def _bf16(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("memory,collective", [("ef", "gather"), ("ef", "two_phase"),
                                               ("loco", "gather")])
def test_memories_and_updates_match_numpy_reference(mesh8, grads, memory, collective):
  """Two steps of top-8 per chunk of 64 with memory, against a numpy re-implementation:
  the updates, every worker's memory and (two-phase) every owner's server memory."""
  codec, steps, beta = codecs.top_k(k=8, chunk=64), 2, 0.5
  out, state = _updates(mesh8, sync.compressed(codec, memory=memory, collective=collective,
                                               beta=beta), grads, steps=steps)
  c = -(-N // W)  # two-phase: device r owns elements [r c, (r + 1) c)
  mem, server = np.zeros((W, N), np.float32), np.zeros((W, W * c), np.float32)
  for t in range(steps):
    sent = np.asarray(grads[t]) + mem  # p_w = g_w + e_w
    if collective == "gather":
      own = _np_top_k(sent)
      total = own.sum(0)
    else:  # each worker encodes its W chunks; owner r sums chunk r, adds its memory
      chunks = np.pad(sent, ((0, 0), (0, W * c - N))).reshape(W * W, c)
      own_chunks = _np_top_k(chunks, chunk=64).reshape(W, W, c)  # [worker, chunk, c]
      own = own_chunks.reshape(W, W * c)[:, :N]
      s = own_chunks.sum(0) + np.stack([server[r, r * c:(r + 1) * c] for r in range(W)])
      reencoded = _np_top_k(s, chunk=64)  # [owner, c]
      for r in range(W):
        server[r, r * c:(r + 1) * c] = s[r] - reencoded[r]
      total = reencoded.reshape(-1)[:N]
    np.testing.assert_allclose(out[t], np.broadcast_to(total / W, (W, N)), atol=1e-5)
    mem = sent - own if memory == "ef" else _bf16(beta * mem + (1 - beta) * (sent - own))
  tol = 1e-5 if memory == "ef" else 1e-2 * np.abs(mem).max()  # loco keeps bf16
  np.testing.assert_allclose(np.asarray(state.memory, np.float32), mem, atol=tol)
  if collective == "two_phase":  # only the owned slots hold an error; the rest stay 0
    np.testing.assert_allclose(np.asarray(state.server_memory), server[:, :N], atol=1e-5)
    assert np.abs(server).max() > 0.1  # the re-encoding really dropped something
  else:
    assert state.server_memory is None


def test_a_memory_of_your_own_composes_and_matches_a_hand_reference(mesh8, grads):
  """A user-written `ErrorMemory` plugs into the compressing stage as the named ones do: two
  steps of top-8 per chunk of 64 against numpy, the updates and both of its buffers."""
  tx = sync.compressed(codecs.top_k(k=8, chunk=64), memory=contract.DAMPED_MEMORY,
                       collective="gather")
  out, state = _updates(mesh8, tx, grads, steps=2)
  e = np.zeros((W, N), np.float32)
  for t in range(2):
    sent = np.asarray(grads[t]) + 0.5 * e
    own = _np_top_k(sent)
    np.testing.assert_allclose(out[t], np.broadcast_to(own.sum(0) / W, (W, N)), atol=1e-5)
    e = sent - own
  np.testing.assert_allclose(np.asarray(state.memory["e"]), e, atol=1e-5)
  assert state.memory["own"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(state.memory["own"], np.float32), _bf16(own),
                             rtol=1e-2, atol=1e-6)


def test_named_memories_are_their_error_memories(mesh8, grads):
  """memory="ef" / "ef21" / "loco" are `sync.error_feedback()` / `ef21()` / `loco(beta)`:
  the same updates and states, bit for bit."""
  codec, key = codecs.top_k(k=8, chunk=64), KEY
  for name, memory in [("ef", sync.error_feedback()), ("ef21", sync.ef21()),
                       ("loco", sync.loco(0.5))]:
    a = _updates(mesh8, sync.compressed(codec, memory=name, beta=0.5, key=key), grads, 2)
    b = _updates(mesh8, sync.compressed(codec, memory=memory, key=key), grads, 2)
    chex.assert_trees_all_equal(a, b)


def test_ef21_aggregate_is_the_mean_of_worker_states(mesh8, grads):
  out, state = _updates(mesh8, sync.compressed(codecs.top_k(0.1), memory="ef21"), grads, steps=3)
  h = np.asarray(state.aggregate)
  np.testing.assert_allclose(h[0], np.asarray(state.memory).mean(0), atol=1e-6)
  np.testing.assert_allclose(out[-1, 0], h[0], atol=1e-6)  # the update direction is h
  assert (h == h[0]).all() and np.abs(h).max() > 0


def test_per_worker_keys_unless_shared(mesh8, grads):
  """Identical gradients everywhere: stochastic rounding differs per worker, random-k does not."""
  same = jnp.broadcast_to(grads[:1, :1], grads[:1].shape)
  for codec, distinct in [(codecs.uniform(2, stochastic=True), True),
                          (codecs.random_k(0.5), False)]:
    tx = sync.compressed(codec, memory="ef", collective="gather", key=KEY)
    _, state = _updates(mesh8, tx, same)
    assert not np.array_equal(state.key[0], tx.init({"w": jnp.zeros(N)}).key)  # split
    mem = np.asarray(state.memory)
    assert (len({m.tobytes() for m in mem}) == W) == distinct, codec.name


# ---------------------------------------------------------------------------- hierarchical
def test_hierarchical_fast_axis_exact_slow_axis_compressed(mesh4x2):
  axes = ("tensor", "data")  # first axis fast (exact), the rest slow (compressed)
  n = sum(x.size for x in jax.tree.leaves(testing.example_params()))
  # Exact codec: the same parameters as sync.mean over both axes, in a training program.
  _, ref, _, _ = testing.check_on_mesh(optax.chain(sync.mean(axes), optax.sgd(0.1)),
                                        mesh4x2, batch_axes=axes)
  _, state, _, _ = testing.check_on_mesh(
      optax.chain(sync.compressed(codecs.identity(), axis_name=axes), optax.sgd(0.1)),
      mesh4x2, batch_axes=axes)
  chex.assert_trees_all_close(state.params, ref.params, atol=1e-6)
  # A lossy codec: float32 on the fast axis, the codec's bytes on the slow axis only.
  codec = codecs.uniform(4, block=64)
  tx = optax.chain(sync.compressed(codec, memory="ef", axis_name=axes), optax.sgd(0.1))
  program, _, m, report = testing.check_on_mesh(tx, mesh4x2, batch_axes=axes)
  assert program.layout.opt_state[0].memory
  assert n == 16  # each of the F = 2 fast devices owns m = 8 slots
  # Fast axis, float32: reduce-scatter of f32[16] (1/2 * 64 bytes) and all-gather of the
  # f32[8] slots (1 * 32 bytes).
  fast = 32 + 32
  # Slow axis, 4 workers, two-phase of 8 slots: chunks of 2 elements, 4-bit codes (1 byte)
  # and one f32 scale: 5 bytes, sent 3 times in each phase: 2 * 3 * 5.
  slow = 30
  assert int(m["wire_bytes"]) == fast + slow
  assert report.wire_bytes(axes=("tensor",)) == fast and report.wire_bytes(axes=("data",)) == slow
  assert {c.dtype for c in report.select(axes=("tensor",))} == {"f32"}


# ---------------------------------------------------------------------------- convergence
def _logistic_task(d=40, per_worker=32, seed=0):
  """Logistic regression whose workers add large opposing linear terms (they cancel in the mean).

  Each worker's own gradient is dominated by +-5 on the first 4 coordinates, so a worker's top-k
  always picks those; without memory, the remaining coordinates are never sent.
  """
  rng = np.random.default_rng(seed)
  w_true = rng.normal(size=d)
  x = rng.normal(size=(W * per_worker, d)).astype(np.float32)
  y = (x @ w_true + 0.5 * rng.normal(size=W * per_worker) > 0).astype(np.float32)
  c = np.zeros((W, d), np.float32)
  c[:, :4] = 5.0 * np.where(np.arange(W) % 2 == 0, 1.0, -1.0)[:, None]

  def loss(p, b):
    z = b["x"] @ p["w"]
    return jnp.mean(optax.sigmoid_binary_cross_entropy(z, b["y"])) + jnp.sum(b["c"][0] * p["w"])

  return {"w": jnp.zeros(d)}, loss, {"x": x, "y": y, "c": c}


def test_top_k_with_memory_tracks_sgd_and_without_stalls(mesh8):
  params, loss, batch = _logistic_task()
  full_loss = jax.jit(lambda p: jnp.mean(optax.sigmoid_binary_cross_entropy(
      batch["x"] @ p["w"], batch["y"])))
  results = {}
  for name, sync_tx in [("sgd", sync.mean()),
                        ("top_k+ef", sync.compressed(codecs.top_k(k=4), memory="ef")),
                        ("top_k", sync.compressed(codecs.top_k(k=4)))]:
    trainer = train.Trainer(loss, optax.chain(sync_tx, optax.sgd(0.5)), mesh8)
    state = trainer.init(params)
    for _ in range(150):
      state, _ = trainer.step(state, batch)
    results[name] = float(full_loss(state.params))
  initial = float(full_loss(params))
  assert results["sgd"] < 0.6 * initial, results
  assert results["top_k+ef"] < results["sgd"] + 0.1 * (initial - results["sgd"]), results
  assert results["top_k"] > results["sgd"] + 0.5 * (initial - results["sgd"]), results


# ---------------------------------------------------------------------------- bytes in state
# The 16 parameters of testing.example_params, W = 8; bytes worked out by hand.
@pytest.mark.parametrize("codec,memory,collective,want", [
    # top-2 of 16 (round(0.1 * 16)): 2 x (f32 value, u8 index) = 10 bytes, gathered: 7 * 10.
    (codecs.top_k(0.1), "ef", None, 70),
    # A quantiser goes two-phase: chunks of 2, 3-bit codes (1 byte) + one f32 scale = 5
    # bytes, 7 times in each phase: 2 * 7 * 5.
    (codecs.uniform(3, stochastic=True, block=8), "ef", None, 70),
    # Shared-key random-4: only the 4 f32 values travel, psum of 16 bytes: 2 * 7/8 * 16.
    (codecs.random_k(0.25), None, None, 28),
    # bf16 (linear but narrow) goes two-phase: chunks of 2 x 2 bytes, 2 * 7 * 4.
    (codecs.cast("bfloat16"), None, None, 56),
    # 16 sign bits (2 bytes) + one f32 scale, gathered: 7 * 6.
    (codecs.sign(), "ef21", "gather", 42),
], ids=lambda v: getattr(v, "name", str(v)))
def test_bytes_in_state_equal_inspect_and_formula(mesh8, codec, memory, collective, want):
  tx = optax.chain(sync.compressed(codec, memory=memory, collective=collective, key=KEY),
                   optax.sgd(0.1))
  program, _, m, _ = testing.check_on_mesh(tx, mesh8)  # asserts counted == comm.inspect
  assert bool(program.layout.opt_state[0].memory) == (memory is not None)  # per worker
  assert sum(x.size for x in jax.tree.leaves(testing.example_params())) == 16
  assert int(m["wire_bytes"]) == want


# ---------------------------------------------------------------------------- bad input
def test_bad_input_fails_when_built():
  bad = [
      (lambda: sync.compressed(codecs.top_k(0.1), collective="psum"), "linear"),
      (lambda: sync.compressed(codecs.cast("bfloat16"), collective="psum"), "two_phase"),
      (lambda: sync.compressed(codecs.qsgd()), "key"),
      (lambda: sync.compressed(codecs.random_k(0.1)), "key"),
      (lambda: sync.compressed(codecs.top_k(0.1), memory="ef14"), "memory"),
      (lambda: sync.compressed(codecs.top_k(0.1), collective="ring"), "collective"),
      (lambda: sync.compressed(codecs.top_k(0.1), collective="gather", server_memory=True),
       "server_memory"),
      (lambda: sync.compressed(codecs.top_k(0.1), memory="loco", beta=1.0), "beta"),
      (lambda: sync.compressed("top_k"), "codec"),
      (lambda: sync.compressed(codecs.sign(), memory="ef", memory_dtype=jnp.int8), "memory_dtype"),
      (lambda: sync.compressed(codecs.sign(), memory=sync.error_feedback(),
                               memory_dtype="bfloat16"), "memory_dtype"),
      (lambda: sync.loco(beta=1.0), "beta"),
      (lambda: sync.error_feedback(jnp.int8), "dtype"),
  ]
  for make, word in bad:
    with pytest.raises(ValueError, match=word):
      make()
