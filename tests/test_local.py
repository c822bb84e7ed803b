"""Local-update schedules on 8 workers against single-device references of W workers.

Each reference below re-implements a method's update rule directly (worker parameters as a
stacked [W, ...] tree, gradients by vmap on one device) and the Trainer's per-worker state
is held against it; bytes are held three ways (counted in state, comm.inspect inside the
conditional, docs/algorithms.md formula). Tiny MLP on digits, few steps: compile time dominates.

Byte formulas are written out by hand for the MLP's parameters (BYTES below), never taken
from the library's helpers; `comm.inspect` shares the counters' per-op byte helpers, so
counted == inspected proves the shapes and branches, and BYTES the convention's arithmetic.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, data, local, models, sync, train
# The property-test helpers of the foundation's validation tests.
from test_validation import (AXIS_NAMES, JUNK, TRANSFORMS, builds_or_value_error, mesh_for,
                             ok, valid_or)

W = 8
B = 64  # global batch: 8 examples per worker
LR = 0.3
NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)

# The MLP 64 -> 16 -> 10 has leaves (in tree order) Dense_0/bias 16, Dense_0/kernel 1024,
# Dense_1/bias 10, Dense_1/kernel 160: n = 1210 float32, 4840 bytes. Per sync, W = 8:
BYTES = {
    "allreduce": 8470,       # all-reduce of every parameter: 2 * 7/8 * 4840
    "scaffold": 2 * 8470,    # θ and Δc in one all-reduce
    # DreamDDP, H = 3: largest leaf first into the lightest of 3 groups: [1024], [160],
    # [16 + 10]; 2 * 7/8 * 4 * size each.
    "dreamddp": {"groups": [[1], [3], [0, 2]], "bytes": [7168, 1120, 182]},
    "streaming": 4235,       # one of 2 fragments, ceil(1210 / 2) = 605 f32: 2 * 7/8 * 2420
    # SparseLoCo, density 0.1, 2 bits, chunk min(4096, 1210): one chunk, k = 121: u16
    # indices 242 bytes + 2-bit codes ceil(242 / 8) = 31 bytes + one f32 scale = 277 bytes,
    # all-gathered: 7 * 277.
    "sparseloco": 1939,
    # Streaming's default fp4 on a 605-element fragment: 4-bit codes ceil(605 / 2) = 303
    # bytes + 19 block scales (32 per block) = 76 bytes = 379, all-gathered: 7 * 379.
    "streaming_fp4": 2653,
    # bf16 outer gradient, two-phase: 1210 padded to 1216 = 8 chunks of 152 x 2 bytes,
    # 7 sent in each phase: 2 * 7 * 304.
    "diloco_bf16": 4256,
    # int8 (block 256) outer gradient, two-phase: 1210 padded to 1216 = 8 chunks of 152;
    # a chunk's payload is 152 one-byte codes + one f32 scale = 156 bytes, 7 sent in each
    # phase: 2 * 7 * 156 (by gather it would be 7 * (1210 + 4 * 5) = 8610).
    "diloco_int8_two_phase": 2184,
    # Streaming's fp4 on a 605-element fragment, two-phase: 8 chunks of 76, each 38 bytes
    # of 4-bit codes + 3 block scales (32 per block) = 50 bytes: 2 * 7 * 50.
    "streaming_fp4_two_phase": 700,
    # Hierarchical, 2 slow x 4 fast: the gradient all-reduce over 4, 2 * 3/4 * 4840; the
    # parameters' over 2, 2 * 1/2 * 4840.
    "fast": 7260, "slow": 4840,
}


# ------------------------------------------------------------------ task and references
@pytest.fixture(scope="module")
def task():
  model = models.MLP(hidden=(16,), num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  ds = data.digits()
  batches = [ds.batch(t, B) for t in range(8)]
  grads = jax.jit(jax.vmap(jax.grad(loss)))  # [W] params, [W] batch blocks -> [W] grads
  return params, loss, batches, grads


def blocks(batch, w=W):
  return jax.tree.map(lambda x: x.reshape(w, -1, *x.shape[1:]), batch)


def stack(tree, w=W):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (w, *x.shape)), tree)


def live_mean(stacked, live):
  """Mean over the live workers (axis 0) of a stacked tree."""
  live = jnp.asarray(live, jnp.float32)
  return jax.tree.map(lambda x: jnp.tensordot(live, x, 1) / live.sum(), stacked)


def run_trainer(loss, tx, params, batches, steps, mesh=None, batch_axes="data"):
  mesh = mesh or train.make_mesh({"data": W})
  trainer = train.Trainer(loss, tx, mesh, batch_axes=batch_axes)
  state = trainer.init(params)
  sent = []
  for t in range(steps):
    state, m = trainer.step(state, batches[t])
    sent.append(int(m["wire_bytes"]))
  return trainer, state, sent


def ref_diloco(task, inner, outer, sync_every, steps, mask=None, params=None):
  """W workers, inner steps by vmap, every H steps the outer step on the live mean."""
  params0, _, batches, grads = task
  theta = params if params is not None else params0
  ps, s = stack(theta), jax.vmap(inner.init)(stack(theta))
  o = outer.init(theta)
  for t in range(1, steps + 1):
    g = grads(ps, blocks(batches[t - 1]))
    u, s = jax.vmap(inner.update)(g, s, ps)
    ps = optax.apply_updates(ps, u)
    if t % sync_every == 0:
      k = t // sync_every - 1
      live = mask[k] if mask is not None and k < len(mask) else np.ones(W)
      delta = live_mean(jax.tree.map(lambda a, b: a - b, stack(theta), ps), live)
      step, o = outer.update(delta, o, theta)
      theta = optax.apply_updates(theta, step)
      ps = stack(theta)
  return ps, s, theta, o


def close(a, b, atol=1e-6):
  chex.assert_trees_all_close(a, b, atol=atol, rtol=1e-5)


# ------------------------------------------------------------------ equivalences
@pytest.fixture(scope="module")
def dp_sgd(task):
  params, loss, batches, _ = task
  return run_trainer(loss, optax.chain(sync.mean("data"), optax.sgd(LR)), params, batches, 3)


def test_diloco_h1_sgd_equals_exact_dp(task, dp_sgd):
  params, loss, batches, _ = task
  _, dp, dp_sent = dp_sgd
  _, dl, dl_sent = run_trainer(loss, local.diloco(optax.sgd(LR), optax.sgd(1.0), 1), params,
                               batches, 3)
  # Float tolerance: θ_out − (θ_out − mean(θ_out − lr g_w)) vs θ − lr mean(g_w): ulps of θ.
  close(jax.tree.map(lambda x: x[0], dl.params), dp.params)
  close(dl.opt_state.outer_params, dp.params)
  assert dl_sent == dp_sent  # the same all-reduce of |θ| every step


def test_local_sgd_h1_equals_exact_dp(task, dp_sgd):
  params, loss, batches, _ = task
  _, dp, _ = dp_sgd
  _, ls, _ = run_trainer(loss, local.local_sgd(optax.sgd(LR), 1), params, batches, 3)
  close(jax.tree.map(lambda x: x[0], ls.params), dp.params)
  close(jax.tree.map(lambda x: x[W - 1], ls.params), dp.params)


# Every schedule's run without a mask is held against its reference below; with an all-live
# mask it must be the same run. One compiled trainer per (schedule, masked).
SGD = optax.sgd(LR)
SCHEDULES = {  # name: (factory(**participation), steps, slow-axis width or None)
    "local_sgd": (lambda **kw: local.local_sgd(SGD, 2, **kw), 4, None),
    "diloco": (lambda **kw: local.diloco(optax.adam(1e-2), NESTEROV, 3, **kw), 6, None),
    "streaming": (lambda **kw: local.streaming_diloco(
        SGD, optax.sgd(0.7, momentum=0.9), 4, 2, 1, 0.5, codec=None, **kw), 8, None),
    "sparseloco": (lambda **kw: local.sparseloco(SGD, 2, 0.1, 2, decay=0.95, **kw), 4, None),
    "dreamddp": (lambda **kw: local.dreamddp(SGD, 3, **kw), 6, None),
    "scaffold": (lambda **kw: local.scaffold(SGD, 2, **kw), 4, None),
    "hierarchical": (lambda **kw: local.hierarchical(
        SGD, 2, "fast", "slow", worker_steps=[2, 1], weighting="steps", **kw), 4, 2),
}


@pytest.fixture(scope="module")
def runs(task):
  params, loss, batches, _ = task
  cache = {}

  def get(name, masked=False):
    if (name, masked) not in cache:
      make, steps, slow = SCHEDULES[name]
      kw = {"participation": np.ones((8, slow or W), bool)} if masked else {}
      mesh = train.make_mesh({"slow": 2, "fast": 4}) if slow else None
      cache[name, masked] = run_trainer(loss, make(**kw), params, batches, steps, mesh=mesh,
                                        batch_axes=("slow", "fast") if slow else "data")
    return cache[name, masked]

  return get


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_all_live_mask_equals_no_mask(runs, name):
  _, a, sent_a = runs(name)
  _, b, sent_b = runs(name, masked=True)
  close(a.params, b.params, atol=1e-7)
  assert sent_a == sent_b and sum(sent_a) > 0


def test_local_sgd_h2_matches_reference(task, runs):
  _, state, _ = runs("local_sgd")
  ps, *_ = ref_diloco(task, SGD, optax.sgd(1.0), 2, 4)  # FedAvg: outer SGD(1)
  close(state.params, ps)


def test_diloco_h3_matches_reference(task, runs):
  _, state, sent = runs("diloco")
  ps, s, theta, o = ref_diloco(task, optax.adam(1e-2), NESTEROV, 3, 6)
  close(state.params, ps)
  close(state.opt_state.outer_params, theta)
  close(state.opt_state.outer_state, o)
  close(state.opt_state.inner_state[0].mu, s[0].mu)
  n = sum(x.size for x in jax.tree.leaves(task[0]))
  assert n == 1210 and sent == [0, 0, BYTES["allreduce"]] * 2


def test_streaming_one_fragment_equals_diloco(task, runs):
  params, loss, batches, _ = task
  _, dl, dl_sent = runs("diloco")
  tx = local.streaming_diloco(optax.adam(1e-2), NESTEROV, 3, fragments=1, overlap=0,
                              alpha=0.0, codec=None)
  _, st, st_sent = run_trainer(loss, tx, params, batches, 6)
  close(st.params, dl.params)
  assert st_sent == dl_sent


def test_diloco_identity_codec_equals_no_codec(task, runs):
  params, loss, batches, _ = task
  _, dl, dl_sent = runs("diloco")
  tx = local.diloco(optax.adam(1e-2), NESTEROV, 3, codec=codecs.identity())
  _, st, st_sent = run_trainer(loss, tx, params, batches, 6)
  close(st.params, dl.params, atol=1e-7)
  assert st_sent == dl_sent


# ------------------------------------------------------------------ participation
def test_two_dropped_workers_lose_no_state_and_rejoin(task):
  """Workers 2 and 5 miss sync 1: the outer step averages the six others; nothing is lost."""
  params, loss, batches, _ = task
  mask = np.ones((2, W), bool)
  mask[1, [2, 5]] = False
  tx = local.diloco(optax.adam(1e-2), NESTEROV, 2, participation=mask)
  trainer, state, sent = run_trainer(loss, tx, params, batches, 6)
  ps, s, theta, o = ref_diloco(task, optax.adam(1e-2), NESTEROV, 2, 6, mask=mask)
  close(state.opt_state.outer_params, theta)
  close(state.opt_state.outer_state, o)
  # Inner optimiser state of every worker, dropped ones included, is kept.
  close(state.opt_state.inner_state[0], jax.tree.map(
      lambda x, pw: x if pw else x[0], s[0], trainer.layout.opt_state.inner_state[0]))
  # Dropped workers rejoined with the outer parameters and trained on.
  close(state.params, ps)
  # The sync they missed differs from the all-live one: the mask took effect.
  *_, theta_all, _ = ref_diloco(task, optax.adam(1e-2), NESTEROV, 2, 4)
  _, _, theta_4, _ = ref_diloco(task, optax.adam(1e-2), NESTEROV, 2, 4, mask=mask)
  assert not np.allclose(jax.tree.leaves(theta_all)[0], jax.tree.leaves(theta_4)[0])
  assert sent[1] == sent[3] == sent[5] > 0  # the same bytes: the collective still runs


def test_participation_callable_and_dropped_worker_rejoins(task):
  """A traceable mask function; a dropped worker's own progress is discarded."""
  params, loss, batches, _ = task
  drop_first = lambda k: jnp.arange(W) != jnp.where(k == 0, 0, -1)  # worker 0 misses sync 0
  _, state, _ = run_trainer(loss, local.local_sgd(optax.sgd(LR), 2,
                                                  participation=drop_first),
                            params, batches, 2)
  mask = np.ones((1, W), bool)
  mask[0, 0] = False
  ps, *_ = ref_diloco(task, optax.sgd(LR), optax.sgd(1.0), 2, 2, mask=mask)
  close(state.params, ps)
  # Worker 0 took the average like everyone: equal up to the rounding of p + (avg - p).
  close(jax.tree.map(lambda x: x[0], state.params), jax.tree.map(lambda x: x[1], state.params),
        atol=1e-8)


# ------------------------------------------------------------------ other references
def test_scaffold_matches_reference(task):
  params, loss, batches, grads = task
  h, steps, mask = 2, 6, np.ones((3, W), bool)
  mask[1, [1, 6]] = False
  _, state, sent = run_trainer(loss, local.scaffold(optax.sgd(LR), h, participation=mask),
                               params, batches, steps)
  ps, zeros = stack(params), jax.tree.map(jnp.zeros_like, stack(params))
  cw, c, gsum = zeros, jax.tree.map(jnp.zeros_like, params), zeros
  for t in range(1, steps + 1):
    g = grads(ps, blocks(batches[t - 1]))
    ps = jax.tree.map(lambda p, g, a, b: p - LR * (g - a + b), ps, g, cw, c)
    gsum = jax.tree.map(jnp.add, gsum, g)
    if t % h == 0:
      live = mask[t // h - 1]
      fresh = jax.tree.map(lambda x: x / h, gsum)
      lw = jnp.asarray(live, jnp.float32)
      c = jax.tree.map(lambda c, f, a: c + jnp.tensordot(lw, f - a, 1) / W, c, fresh, cw)
      cw = jax.tree.map(lambda f, a: jnp.where(
          lw.reshape(-1, *[1] * (f.ndim - 1)) > 0, f, a), fresh, cw)
      ps, gsum = stack(live_mean(ps, live)), zeros
  close(state.params, ps, atol=2e-6)
  close(state.opt_state.control, cw, atol=2e-6)
  close(state.opt_state.global_control, c, atol=2e-6)
  assert sent == [0, BYTES["scaffold"]] * 3  # θ and Δc


def test_dreamddp_matches_reference_and_syncs_each_leaf_once(task, runs):
  params, loss, batches, grads = task
  h, steps = 3, 6
  _, state, sent = runs("dreamddp")
  leaves, treedef = jax.tree.flatten(params)
  groups = local.layer_groups([x.size for x in leaves], min(h, len(leaves)))
  assert groups == BYTES["dreamddp"]["groups"]
  ps = stack(params)
  for t in range(1, steps + 1):
    ps = jax.tree.map(lambda p, g: p - LR * g, ps, grads(ps, blocks(batches[t - 1])))
    slot = [g for g in range(len(groups)) if t % h == g * h // len(groups)]
    if slot:
      flat = jax.tree.leaves(ps)
      for i in groups[slot[0]]:
        flat[i] = jnp.broadcast_to(flat[i].mean(0), flat[i].shape)
      ps = jax.tree.unflatten(treedef, flat)
  close(state.params, ps)
  # Group g syncs at t mod 3 == g: t = 1, 2, 3 send groups 1, 2, 0.
  g_bytes = BYTES["dreamddp"]["bytes"]
  assert sent == [g_bytes[1], g_bytes[2], g_bytes[0]] * 2
  # A whole period sends one all-reduce of |θ|, like local SGD, but the peak is smaller.
  assert sum(sent[:h]) == BYTES["allreduce"] > max(sent)


def test_streaming_overlap_and_mixing_match_reference(task, runs):
  params, loss, batches, grads = task
  h, frags, tau, alpha, steps = 4, 2, 1, 0.5, 8
  _, state, sent = runs("streaming")
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  n = flat(params).size
  leaves, treedef = jax.tree.flatten(params)
  worker = np.stack([flat(params)] * W)             # [W, n]
  outer = flat(params).copy()
  mom = np.zeros_like(outer)
  offsets = [p * h // frags for p in range(frags)]
  sizes = np.cumsum([x.size for x in leaves])[:-1]

  def unflat(v):
    parts = np.split(v, sizes)
    return jax.tree.unflatten(treedef, [a.reshape(x.shape) for a, x in zip(parts, leaves)])

  for t in range(1, steps + 1):
    ps = jax.tree.map(lambda *xs: jnp.stack(xs), *[unflat(w) for w in worker])
    g = grads(ps, blocks(batches[t - 1]))
    worker = worker - LR * np.stack([flat(jax.tree.map(lambda x: x[w], g)) for w in range(W)])
    elems = lambda p: np.arange(n)[np.arange(n) % frags == p]
    if t % h in offsets:
      idx = elems(offsets.index(t % h))
      delta = (outer[idx] - worker[:, idx]).mean(0)
      mom[idx] = 0.9 * mom[idx] + delta
      outer[idx] = outer[idx] - 0.7 * mom[idx]
    if t - tau >= 1 and (t - tau) % h in offsets:
      idx = elems(offsets.index((t - tau) % h))
      worker[:, idx] = alpha * worker[:, idx] + (1 - alpha) * outer[idx]
  got = np.stack([flat(jax.tree.map(lambda x: x[w], state.params)) for w in range(W)])
  np.testing.assert_allclose(got, worker, atol=1e-5)
  assert [s for s in sent if s] == [BYTES["streaming"]] * 4  # t = 2, 4, 6, 8


def np_topk_chunks(rows, density, bits, chunk):
  """numpy reference of SparseLoCo's message: per chunk the k largest magnitudes, values
  rounded to the nearest of 2**bits levels spread evenly over [-s, s], s = the chunk's largest
  kept magnitude."""
  rows = np.asarray(rows, np.float32)
  n = rows.shape[-1]
  c = min(chunk, n)
  m = -(-n // c)
  k = max(1, min(c, round(density * c)))
  x = np.pad(rows, ((0, 0), (0, m * c - n))).reshape(len(rows), m, c)
  keep = np.argsort(-np.abs(x), axis=-1, kind="stable")[..., :k]
  vals = np.take_along_axis(x, keep, axis=-1)
  s = np.max(np.abs(vals), axis=-1, keepdims=True)
  levels = 2**bits - 1
  codes = np.clip(np.round((vals / np.where(s > 0, s, 1) + 1) * 0.5 * levels), 0, levels)
  out = np.zeros_like(x)
  np.put_along_axis(out, keep, ((codes / levels * 2 - 1) * s).astype(np.float32), axis=-1)
  return out.reshape(len(rows), -1)[:, :n]


def test_sparseloco_matches_reference(task, runs):
  params, loss, batches, grads = task
  h, steps, density, beta = 2, 4, 0.1, 0.95
  _, state, sent = runs("sparseloco")
  roundtrip = lambda rows: jnp.asarray(np_topk_chunks(rows, density, 2, 4096))
  theta, ps = params, stack(params)
  vec = lambda tree: codecs.flatten(tree)[0]
  n = vec(params).size
  mem = jnp.zeros((W, n))
  for t in range(1, steps + 1):
    ps = jax.tree.map(lambda p, g: p - LR * g, ps, grads(ps, blocks(batches[t - 1])))
    if t % h == 0:
      delta = jax.vmap(lambda p: vec(jax.tree.map(jnp.subtract, theta, p)))(ps)
      e = beta * mem + delta
      sent_vals = roundtrip(e)
      mem = e - sent_vals
      _, unflatten = codecs.flatten(params)
      theta = jax.tree.map(lambda a, b: a - b, theta, unflatten(sent_vals.mean(0)))
      ps = stack(theta)
  close(state.params, ps, atol=1e-5)
  close(state.opt_state.memory, mem, atol=1e-5)
  assert sent == [0, BYTES["sparseloco"]] * 2


def test_hierarchical_wp_sgd_matches_reference(task, runs):
  """2 slow groups x 4 fast workers; group 1 computes 1 of every 2 steps; WP-SGD weights."""
  params, loss, batches, grads = task
  h, steps, wsteps = 2, 4, [2, 1]
  trainer, state, sent = runs("hierarchical")
  ps = stack(params, 2)
  for t in range(1, steps + 1):
    g = grads(jax.tree.map(lambda x: jnp.repeat(x, 4, axis=0), ps), blocks(batches[t - 1]))
    g = jax.tree.map(lambda x: x.reshape(2, 4, *x.shape[1:]).mean(1), g)
    busy = jnp.asarray([(t - 1) % h < s for s in wsteps], jnp.float32)
    ps = jax.tree.map(lambda p, g: p - LR * g * busy.reshape(-1, *[1] * (g.ndim - 1)), ps, g)
    if t % h == 0:
      ps = stack(live_mean(ps, np.asarray(wsteps, np.float32)), 2)
  close(state.params, ps)  # stored once per slow group: equal inside a fast group
  fast, slow = BYTES["fast"], BYTES["slow"]
  assert sent == [fast, fast + slow] * 2
  batch = batches[0]
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  assert report.wire_bytes(axes=("fast",), conditional=False) == fast
  assert report.wire_bytes(axes=("slow",), conditional=True) == slow
  assert report.wire_bytes() == fast + slow


def test_checkpoint_mid_period_resumes_exactly(task, tmp_path):
  """Per-worker parameters, error memory, outer state and counter survive an Orbax round trip."""
  params, loss, batches, _ = task
  tx = local.diloco(optax.adam(1e-2), NESTEROV, 3, codec=codecs.cast("bfloat16"), memory="ef")
  trainer = train.Trainer(loss, tx, train.make_mesh({"data": W}))
  state = trainer.init(params)
  for t in range(4):  # a sync at 3, then mid-period
    state, _ = trainer.step(state, batches[t])
  ckpt = train.Checkpointer(str(tmp_path), every=1, async_save=False)
  ckpt.save(state)
  restored, _ = ckpt.restore(trainer.program, trainer.init(params))
  ckpt.close()
  chex.assert_trees_all_equal(restored, state)
  a, b = state, restored
  for t in range(4, 6):  # through the next sync
    a, _ = trainer.step(a, batches[t])
    b, _ = trainer.step(b, batches[t])
  chex.assert_trees_all_equal(a, b)


# ------------------------------------------------------------------ bytes, three ways
def _sync_bytes(name):
  """Bytes of each sync over one period of a SCHEDULES run (BYTES, worked out by hand)."""
  if name == "streaming":
    return [BYTES["streaming"]] * 2
  if name in ("sparseloco", "scaffold"):
    return [BYTES[name]]
  if name == "dreamddp":
    return BYTES["dreamddp"]["bytes"]
  return [BYTES["allreduce"]]


@pytest.mark.parametrize("name", ["local_sgd", "diloco", "streaming", "sparseloco",
                                  "dreamddp", "scaffold"])
def test_bytes_counted_equal_inspect_and_formula(task, runs, name):
  params, _, batches, _ = task
  trainer, state, sent = runs(name)
  period = _sync_bytes(name)
  steps = SCHEDULES[name][1]
  assert sorted(s for s in sent if s) == sorted(period * (len([s for s in sent if s])
                                                          // len(period)))
  report = comm.inspect(trainer.step_fn(state, batches[0]), state, batches[0])
  assert report.wire_bytes(conditional=False) == 0  # nothing travels outside a sync
  # Streaming's one branch serves every fragment (dynamic index): one sync's bytes; the
  # other methods have a branch per distinct sync, so the compiled total is the period's.
  expected = period[0] if name == "streaming" else sum(period)
  assert report.wire_bytes(conditional=True) == expected
  ops = {c.op for c in report}
  assert ops == ({"all-gather"} if name == "sparseloco" else {"all-reduce"})
  assert {c.axes for c in report} == {("data",)}
  # Per step, on average: the period's bytes spread over its H steps.
  h = {"local_sgd": 2, "diloco": 3, "streaming": 4, "sparseloco": 2, "dreamddp": 3,
       "scaffold": 2}[name]
  assert sum(sent) == pytest.approx(sum(period) * steps / h)


def test_cast_codec_outer_gradient_travels_narrow(task):
  """bf16 outer gradient with error feedback: two-phase in u16 bits, f32 accumulation."""
  params, loss, batches, grads = task
  tx = local.diloco(SGD, optax.sgd(1.0), 2, codec=codecs.cast("bfloat16"), memory="ef")
  trainer, state, sent = run_trainer(loss, tx, params, batches, 2)
  formula = BYTES["diloco_bf16"]  # two-phase, padded to W
  report = comm.inspect(trainer.step_fn(state, batches[0]), state, batches[0])
  assert sent == [0, formula] and report.wire_bytes(conditional=True) == formula
  assert {c.dtype for c in report} == {"u16"}  # bf16 bits, not widened to f32
  # Reference: each worker rounds δ_w to bf16, the sum is taken in f32 and rounded to bf16
  # for the all-gather; the memory keeps δ_w − bf16(δ_w).
  ps = stack(params)
  for t in range(2):
    ps = jax.tree.map(lambda p, g: p - LR * g, ps, grads(ps, blocks(batches[t])))
  flat, unflatten = codecs.flatten(params)
  delta = flat[None] - jax.vmap(lambda p: codecs.flatten(p)[0])(ps)
  sent_w = delta.astype(jnp.bfloat16).astype(jnp.float32)
  total = jnp.sum(sent_w, axis=0).astype(jnp.bfloat16).astype(jnp.float32)
  close(state.opt_state.outer_params, unflatten(flat - total / W), atol=1e-4)
  close(state.opt_state.memory, delta - sent_w, atol=1e-7)


def test_int8_outer_gradient_two_phase_equals_a_chunked_reference(task):
  """collective="two_phase": every worker encodes its 8 chunks of δ_w, chunk j's owner sums
  the 8 decodes and re-encodes the sum for the all-gather; the error memory keeps δ_w minus
  what its own chunks decode to. The codec is used as a black box (encode then decode)."""
  params, loss, batches, grads = task
  codec = codecs.uniform(8, block=256)
  tx = local.diloco(SGD, optax.sgd(1.0), 2, codec=codec, memory="ef", collective="two_phase")
  trainer, state, sent = run_trainer(loss, tx, params, batches, 2)
  formula = BYTES["diloco_int8_two_phase"]
  report = comm.inspect(trainer.step_fn(state, batches[0]), state, batches[0])
  assert sent == [0, formula] and report.wire_bytes(conditional=True) == formula
  ps = stack(params)
  for t in range(2):
    ps = jax.tree.map(lambda p, g: p - LR * g, ps, grads(ps, blocks(batches[t])))
  flat, unflatten = codecs.flatten(params)
  n = flat.shape[0]
  delta = np.asarray(flat[None] - jax.vmap(lambda p: codecs.flatten(p)[0])(ps))
  c = -(-n // W)
  chunks = np.pad(delta, ((0, 0), (0, W * c - n))).reshape(W, W, c)  # [worker, chunk, c]
  roundtrip = jax.jit(lambda x: codec.decode(codec.encode(x, None), x.shape[0]))
  sent_w = np.stack([[np.asarray(roundtrip(chunks[w, j])) for j in range(W)]
                     for w in range(W)])
  total = np.concatenate([np.asarray(roundtrip(jnp.asarray(sent_w[:, j].sum(0))))
                          for j in range(W)])[:n]
  close(state.opt_state.outer_params, unflatten(flat - total / W), atol=1e-6)
  own = sent_w.reshape(W, W * c)[:, :n]
  close(state.opt_state.memory, delta - own, atol=1e-7)


def test_streaming_fp4_two_phase_bytes(task):
  params, loss, batches, _ = task
  tx = local.streaming_diloco(optax.sgd(LR), NESTEROV, 4, 2, 1, 0.5, collective="two_phase")
  trainer, state, sent = run_trainer(loss, tx, params, batches, 4)
  report = comm.inspect(trainer.step_fn(state, batches[0]), state, batches[0])
  formula = BYTES["streaming_fp4_two_phase"]
  assert [s for s in sent if s] == [formula] * 2
  assert report.wire_bytes(conditional=True) == formula


@pytest.mark.parametrize("factory,kwargs,words", [
    (local.diloco, dict(collective="two_phase"), "collective='two_phase' needs a codec"),
    (local.diloco, dict(codec=codecs.uniform(8), collective="psum"),
     "collective must be one of None, 'gather', 'two_phase'"),
    (local.diloco, dict(codec=lambda shapes: codecs.tiled_dct_top_k(shapes, 4, 2),
                        collective="two_phase"), "needs the whole vector"),
    (local.streaming_diloco, dict(codec=None, collective="gather"), "needs a codec"),
])
def test_collective_is_checked_when_built(factory, kwargs, words):
  with pytest.raises(ValueError, match=words):
    factory(SGD, optax.sgd(1.0), 2, **kwargs)


def test_shared_key_codec_outer_gradient_is_decoded_with_the_key(task):
  """random_k with a shared key is linear: every worker keeps the same k coordinates, only
  the values are all-reduced, and the receiver regenerates the indices from the key."""
  params, loss, batches, grads = task
  codec = codecs.random_k(k=64)
  tx = local.diloco(SGD, optax.sgd(1.0), 2, codec=codec)
  _, state, sent = run_trainer(loss, tx, params, batches, 2)
  assert sent == [0, 448]  # psum of the 64 float32 values (256 bytes): 2 * 7/8 * 256
  ps = stack(params)
  for t in range(2):
    ps = jax.tree.map(lambda p, g: p - LR * g, ps, grads(ps, blocks(batches[t])))
  flat, unflatten = codecs.flatten(params)
  delta = flat[None] - jax.vmap(lambda p: codecs.flatten(p)[0])(ps)
  sub = jax.random.split(jax.random.key_data(jax.random.key(0)))[1]  # the sync's shared key
  total = sum(jax.jit(codec.roundtrip)(d, sub) for d in delta)
  assert 0 < int(jnp.count_nonzero(total)) <= 64  # at most the k shared coordinates
  close(state.opt_state.outer_params, unflatten(flat - total / W), atol=1e-6)


def test_streaming_default_codec_bytes_in_compiled_program(task):
  params, loss, batches, _ = task
  tx = local.streaming_diloco(optax.sgd(LR), NESTEROV, 4, 2, 1, 0.5)  # codec "auto": fp4
  trainer, state, sent = run_trainer(loss, tx, params, batches, 4)
  report = comm.inspect(trainer.step_fn(state, batches[0]), state, batches[0])
  formula = BYTES["streaming_fp4"]  # non-linear fp4 codes travel by gather
  assert [s for s in sent if s] == [formula] * 2
  assert report.wire_bytes(conditional=True) == formula
  assert report.wire_bytes(conditional=False) == 0


# ------------------------------------------------------------------ pieces
def test_phases_sync_index_counts_syncs():
  phases = local._core.Phases(6, [0, 2, 4])
  seen = -1
  for t in range(0, 20):
    slot = int(phases.slot(jnp.int32(t)))
    expect = [0, 2, 4].index(t % 6) if t >= 1 and t % 6 in (0, 2, 4) else -1
    assert slot == expect
    if slot >= 0:
      seen += 1
      assert int(phases.sync_index(jnp.int32(t))) == seen


def test_topk_chunks_codec_against_numpy():
  x = jax.random.normal(jax.random.key(1), (1000,))
  exact = local.topk_chunks(0.1, None, 256)
  out = np.asarray(jax.jit(exact.roundtrip)(x))
  xs = np.pad(np.asarray(x), (0, 24)).reshape(4, 256)
  ref = np.zeros_like(xs)
  for r in range(4):
    keep = np.argsort(-np.abs(xs[r]))[:26]
    ref[r, keep] = xs[r, keep]
  np.testing.assert_array_equal(out, ref.reshape(-1)[:1000])
  # 4 chunks of 256, k = round(25.6) = 26 each: 104 u8 indices, ceil(104 bits / 8) bytes of
  # codes, 4 f32 scales.
  for bits, nbytes in ((1, 133), (2, 146), (4, 172), (8, 224)):
    codec = local.topk_chunks(0.1, bits, 256)
    payload = jax.eval_shape(codec.encode, x, None)
    assert sum(math.prod(a.shape) * a.dtype.itemsize for a in payload) == nbytes
    assert codec.payload_bytes(1000) == nbytes
    got = np.asarray(jax.jit(codec.roundtrip)(x))
    np.testing.assert_allclose(got, np_topk_chunks(x[None], 0.1, bits, 256)[0], rtol=1e-6)
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(out))
    scale = np.abs(ref).max(1).repeat(256)[:1000]
    step = 2 * scale / (2**bits - 1)
    assert np.all(np.abs(got - out) <= step / 2 + 1e-6)


# ------------------------------------------------------------------ bad input
def test_bad_input_fails_at_build_time(task):
  inner = optax.sgd(0.1)
  for bad in (0, -1, 1.5):
    with pytest.raises(ValueError, match="sync_every"):
      local.local_sgd(inner, bad)
    with pytest.raises(ValueError, match="sync_every"):
      local.diloco(inner, inner, bad)
  with pytest.raises(ValueError, match="fragments"):
    local.streaming_diloco(inner, inner, 4, fragments=0)
  with pytest.raises(ValueError, match="fragments"):
    local.streaming_diloco(inner, inner, 4, fragments=5)
  with pytest.raises(ValueError, match="overlap"):
    local.streaming_diloco(inner, inner, 4, 2, overlap=4)
  with pytest.raises(ValueError, match="alpha"):
    local.streaming_diloco(inner, inner, 4, 2, 0, alpha=1.5)
  with pytest.raises(ValueError, match="alpha"):
    local.streaming_diloco(inner, inner, 4, 2, 0, alpha=-0.1)
  with pytest.raises(ValueError, match="participation"):
    local.diloco(inner, inner, 2, participation=[[True, False], [True]])
  with pytest.raises(ValueError, match="participation"):
    local.diloco(inner, inner, 2, participation=np.ones(W, bool))
  with pytest.raises(ValueError, match="at least one live"):
    local.local_sgd(inner, 2, participation=np.zeros((1, W), bool))
  with pytest.raises(ValueError, match="memory"):
    local.diloco(inner, inner, 2, memory="ef21")
  with pytest.raises(ValueError, match="codec"):
    local.diloco(inner, inner, 2, memory="ef")
  with pytest.raises(ValueError, match="codec"):
    local.diloco(inner, inner, 2, codec="fp4")
  with pytest.raises(ValueError, match="density"):
    local.sparseloco(inner, 2, density=0.0)
  with pytest.raises(ValueError, match="bits"):
    local.sparseloco(inner, 2, bits=3)
  with pytest.raises(ValueError, match="weighting"):
    local.hierarchical(inner, 2, weighting="flops")
  with pytest.raises(ValueError, match="worker_steps"):
    local.hierarchical(inner, 2, worker_steps=[1, 3])
  # Fragments beyond the parameter leaves: known once the transform meets the parameters.
  with pytest.raises(ValueError, match="leaves"):
    local.streaming_diloco(inner, inner, 8, fragments=8, codec=None).init(task[0])
  # A mask whose width is not the number of workers: raised by Trainer.init, before a step.
  params, loss, _, _ = task
  tx = local.diloco(inner, inner, 2, participation=np.ones((2, 6), bool))
  with pytest.raises(ValueError, match="participation has 6 workers"):
    train.Trainer(loss, tx, train.make_mesh({"data": W})).init(params)


# ------------------------------------------------------------------ property: build or ValueError
FEW = settings(max_examples=10, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
H = valid_or(st.integers(1, 3))
# "ones": an all-live mask as wide as the axis (filled in by the test, which knows the mesh).
MASKS = valid_or(st.sampled_from([None, "ones"]))


def _mask(participation, axis_name):
  if participation != "ones":
    return participation
  return np.ones((2, 1 if axis_name is None else W), bool)


def runs_one_update(tx, axis_name):
  """One update (a sync when H = 1) inside shard_map; per-worker updates leave per worker.

  A few checks need the mesh or the parameters (a mask's width, fragments against the
  leaves): they raise ValueError at init or at the first trace, which the property allows
  only for an argument drawn from junk.
  """
  params = {"w": jnp.arange(3.0), "b": jnp.ones(())}
  axes = () if axis_name is None else (axis_name if isinstance(axis_name, tuple) else
                                       (axis_name,))

  def update(p):  # each worker's own gradient (varying), as the Trainer passes it
    grads = jax.tree.map(lambda x: x + 1, comm.varying(p, axes))
    out = tx.update(grads, tx.init(p), p)[0]
    return jax.tree.map(lambda x: comm.varying(x, axes)[None], out)

  if not axes:
    out = update(params)
  else:
    out = jax.jit(jax.shard_map(update, mesh=mesh_for(axis_name), in_specs=P(),
                                out_specs=P(axes)))(params)
  # On the host: an eager isfinite on arrays of each example's mesh compiles two programs.
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(out))


def _schedule(factory):
  """`factory(inner, sync_every, axis_name, participation=...)` with the mask filled in."""
  return lambda inner, sync_every, axis_name, participation, **kw: factory(
      inner, sync_every, axis_name, participation=_mask(participation, axis_name), **kw)


@settings(FEW, max_examples=6)  # three factories per example
@given(inner=TRANSFORMS, h=H, axis_name=AXIS_NAMES, mask=MASKS)
@example(inner=ok(optax.sgd(0.1)), h=ok(1), axis_name=ok(("a", "b")), mask=ok("ones"))
def test_local_sgd_dreamddp_scaffold_builds_or_raise_value_error(inner, h, axis_name, mask):
  for factory in (local.local_sgd, local.dreamddp, local.scaffold):
    builds_or_value_error(_schedule(factory), lambda tx: runs_one_update(tx, axis_name.value),
                          inner=inner, sync_every=h, axis_name=axis_name, participation=mask)


def _diloco_joint(values):  # error feedback of what? a memory needs a codec
  return ("memory", "codec") if values["memory"] == "ef" and values["codec"] is None else ()


@FEW
@given(inner=TRANSFORMS, outer=TRANSFORMS, h=H, axis_name=AXIS_NAMES,
       codec=valid_or(st.sampled_from([None, codecs.identity(), codecs.cast("bfloat16")])),
       memory=valid_or(st.sampled_from([None, "ef"])), mask=MASKS)
@example(inner=ok(optax.adam(0.1)), outer=ok(optax.sgd(0.7)), h=ok(1), axis_name=ok("data"),
         codec=ok(codecs.cast("bfloat16")), memory=ok("ef"), mask=ok("ones"))
def test_diloco_builds_or_raises_value_error(inner, outer, h, axis_name, codec, memory, mask):
  builds_or_value_error(
      lambda inner, outer, sync_every, axis_name, participation, **kw: local.diloco(
          inner, outer, sync_every, axis_name, participation=_mask(participation, axis_name),
          **kw),
      lambda tx: runs_one_update(tx, axis_name.value), joint=_diloco_joint,
      inner=inner, outer=outer, sync_every=h, axis_name=axis_name, codec=codec, memory=memory,
      participation=mask)


def _streaming_joint(values):  # at most one fragment per step; merged before its next sync
  h, bad = values["sync_every"], []
  if isinstance(h, int) and isinstance(values["fragments"], int) and values["fragments"] > h:
    bad.append("fragments")
  if isinstance(h, int) and isinstance(values["overlap"], int) and values["overlap"] >= h:
    bad.append("overlap")
  return bad


@FEW
@given(inner=TRANSFORMS, h=H, fragments=valid_or(st.integers(1, 2)),
       overlap=valid_or(st.integers(0, 2)), alpha=valid_or(st.floats(0, 1)),
       axis_name=AXIS_NAMES, codec=valid_or(st.sampled_from(["auto", None])),
       compensation=valid_or(st.sampled_from([None, "dc"])),
       dc_lambda=valid_or(st.floats(0, 10)))
@example(inner=ok(optax.sgd(0.1)), h=ok(2), fragments=ok(2), overlap=ok(1), alpha=ok(0.5),
         axis_name=ok("data"), codec=ok("auto"), compensation=ok(None), dc_lambda=ok(1.0))
@example(inner=ok(optax.adam(0.1)), h=ok(2), fragments=ok(2), overlap=ok(1), alpha=ok(0.5),
         axis_name=ok("data"), codec=ok(None), compensation=ok("dc"), dc_lambda=ok(3.0))
def test_streaming_diloco_builds_or_raises_value_error(inner, h, fragments, overlap, alpha,
                                                      axis_name, codec, compensation,
                                                      dc_lambda):
  builds_or_value_error(
      lambda inner, sync_every, **kw: local.streaming_diloco(inner, optax.sgd(0.7), sync_every,
                                                             **kw),
      lambda tx: runs_one_update(tx, axis_name.value), joint=_streaming_joint,
      inner=inner, sync_every=h, fragments=fragments, overlap=overlap, alpha=alpha,
      axis_name=axis_name, codec=codec, compensation=compensation, dc_lambda=dc_lambda)


@FEW
@given(inner=TRANSFORMS, h=H, density=valid_or(st.floats(0.01, 1)),
       bits=valid_or(st.sampled_from([1, 2, 4, 8, None])), axis_name=AXIS_NAMES,
       chunk=valid_or(st.integers(1, 8)), decay=valid_or(st.floats(0, 1)),
       outer_lr=valid_or(st.floats(0.1, 2)))
@example(inner=ok(optax.sgd(0.1)), h=ok(1), density=ok(0.5), bits=ok(2), axis_name=ok("data"),
         chunk=ok(2), decay=ok(0.9), outer_lr=ok(1.0))
def test_sparseloco_builds_or_raises_value_error(inner, h, density, bits, axis_name, chunk,
                                                 decay, outer_lr):
  builds_or_value_error(
      lambda inner, sync_every, **kw: local.sparseloco(inner, sync_every, **kw),
      lambda tx: runs_one_update(tx, axis_name.value), inner=inner, sync_every=h,
      density=density, bits=bits, axis_name=axis_name, chunk=chunk, decay=decay,
      outer_lr=outer_lr)


@FEW
@given(inner=TRANSFORMS, h=H,
       worker_steps=valid_or(st.sampled_from([None, (1, 1, 1, 1)]),  # 4 slow workers
                             st.one_of(JUNK, st.just((0, 9)), st.just((1, 1)))),
       weighting=valid_or(st.sampled_from(["uniform", "steps"])))
@example(inner=ok(optax.sgd(0.1)), h=ok(1), worker_steps=ok((1, 1, 1, 1)), weighting=ok("steps"))
def test_hierarchical_builds_or_raises_value_error(inner, h, worker_steps, weighting):
  builds_or_value_error(
      lambda inner, sync_every, **kw: local.hierarchical(inner, sync_every, "fast", "slow",
                                                         **kw),
      lambda tx: runs_one_update(tx, ("slow", "fast")), inner=inner, sync_every=h,
      worker_steps=worker_steps, weighting=weighting)


@FEW
@given(num_workers=valid_or(st.integers(1, 8)), alpha=valid_or(st.floats(0.1, 100)))
@example(num_workers=ok(8), alpha=ok(0.1))
def test_label_skew_builds_or_raises_value_error(num_workers, alpha):
  builds_or_value_error(lambda **kw: data.label_skew(data.digits(), **kw),
                        lambda ds: ds.batch(0, 8 * num_workers.value),
                        num_workers=num_workers, alpha=alpha)

