"""The local-update skeleton `local.periodic` against references of W workers on one device.

A least-squares problem small enough that compiling dominates: 8 workers, each with its own
block of the batch; the references keep the worker parameters stacked [W, ...] and take the
gradients by vmap. Bytes are held three ways: counted in the state, `comm.inspect` of the
compiled step, and a literal worked out here.
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm import comm, local, sync, train

W = 8
LR = 0.1
# Parameters: w f32[6, 3] and b f32[3]: 21 float32 = 84 bytes.
PARAMS = {"b": jnp.zeros(3), "w": jnp.zeros((6, 3))}


def loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def batch_at(t):
  """32 examples (4 per worker), a different draw at every step."""
  kx, ky = jax.random.split(jax.random.key(t))
  return {"x": jax.random.normal(kx, (32, 6)), "y": jax.random.normal(ky, (32, 3))}


GRADS = jax.jit(jax.vmap(jax.grad(loss)))  # [W] params, [W] batch blocks -> [W] gradients


def blocks(batch):
  return jax.tree.map(lambda x: x.reshape(W, -1, *x.shape[1:]), batch)


def run(tx, steps):
  trainer = train.Trainer(loss, tx, train.make_mesh({"data": W}))
  state = trainer.init(PARAMS)
  sent = []
  for t in range(steps):
    state, m = trainer.step(state, batch_at(t))
    sent.append(int(m["wire_bytes"]))
  return trainer, state, sent


def average(axis_name="data"):
  """Local SGD's sync rule: the weighted mean of the live workers' parameters."""
  def sync_fn(params, state, info):
    avg, nbytes = local.masked_average(params, info.mine, info.total, axis_name)
    return avg, state, nbytes
  return sync_fn


def test_every_step_with_inner_sgd_is_data_parallelism():
  _, dp, dp_sent = run(optax.chain(sync.mean("data"), optax.sgd(LR)), 3)
  _, pe, pe_sent = run(local.periodic(optax.sgd(LR), 1, average()), 3)
  # mean_w(θ − lr g_w) against θ − lr mean_w g_w: float rounding of θ only.
  chex.assert_trees_all_close(jax.tree.map(lambda x: x[W - 1], pe.params), dp.params,
                              atol=1e-6)
  assert pe_sent == dp_sent == [147] * 3  # 21 float32 all-reduced: 2 * 7/8 * 84


STEPS = [2, 2, 1, 2, 2, 1, 2, 1]  # workers 2, 5 and 7 compute 1 of every 2 updates
WEIGHTS = [1.0, 1.0, 3.0, 1.0, 2.0, 1.0, 1.0, 1.0]
MASK = np.ones((2, W), bool)
MASK[1, [0, 5]] = False  # workers 0 and 5 miss sync 1


def test_idle_workers_participation_and_weights_match_reference():
  h, steps = 2, 4
  tx = local.periodic(optax.sgd(LR), h, average(), worker_steps=STEPS, worker_weights=WEIGHTS,
                      participation=MASK)
  _, state, sent = run(tx, steps)
  ps = jax.tree.map(lambda x: jnp.broadcast_to(x, (W, *x.shape)), PARAMS)
  for t in range(1, steps + 1):
    g = GRADS(ps, blocks(batch_at(t - 1)))
    busy = jnp.asarray([(t - 1) % h < s for s in STEPS], jnp.float32)
    ps = jax.tree.map(lambda p, g: p - LR * g * busy.reshape(-1, *[1] * (g.ndim - 1)), ps, g)
    if t % h == 0:
      wts = jnp.asarray(MASK[t // h - 1] * np.asarray(WEIGHTS), jnp.float32)
      ps = jax.tree.map(lambda x: jnp.broadcast_to(jnp.tensordot(wts, x, 1) / wts.sum(),
                                                   x.shape), ps)
  chex.assert_trees_all_close(state.params, ps, atol=1e-6)
  assert sent == [0, 147] * 2
  # The idle workers' inner state is untouched too (a counter that only busy steps advance).
  tx_count = local.periodic(optax.scale_by_adam(), h, average(), worker_steps=STEPS)
  _, counted, _ = run(optax.chain(tx_count, optax.scale(-LR)), 3)
  np.testing.assert_array_equal(counted.opt_state[0].inner_state.count,
                                [3 if s == 2 else 2 for s in STEPS])


def head_only(axis_name="data"):
  """A schedule of one's own: average the layer `w` every sync, keep `b` per worker."""
  def sync_fn(params, state, info):
    avg, nbytes = local.masked_average({"w": params["w"]}, info.mine, info.total, axis_name)
    return {**params, **avg}, state, nbytes
  return sync_fn


def test_custom_schedule_bytes_counted_inspected_and_by_hand():
  trainer, state, sent = run(local.periodic(optax.sgd(LR), 3, head_only()), 3)
  by_hand = 126  # w: 18 float32 = 72 bytes, all-reduced over 8: 2 * 7/8 * 72
  assert sent == [0, 0, by_hand]
  report = comm.inspect(trainer.step_fn(state, batch_at(0)), state, batch_at(0))
  assert report.wire_bytes(conditional=True) == by_hand
  assert report.wire_bytes(conditional=False) == 0
  assert int(state.opt_state.wire_bytes) == by_hand  # the cumulative counter
  # w was averaged (equal on every worker up to the rounding of p + (mean - p)), b was not.
  assert np.ptp(np.asarray(state.params["w"]), axis=0).max() < 1e-6
  assert np.ptp(np.asarray(state.params["b"]), axis=0).max() > 1e-3


def test_sync_fn_sees_slot_index_key_and_its_own_state():
  """One device: two slots at offsets 0 and 2 of H = 3; the state records what it saw."""

  class RecordState(NamedTuple):
    count: jax.Array
    inner_state: object
    wire_bytes: jax.Array
    key: jax.Array
    seen: jax.Array  # i32[4]: t, sync index, slot, first word of the key, of the last sync

  def record(params, state, info):
    seen = jnp.stack([info.t, info.index, info.slot,
                      jax.random.key_data(info.key)[0].astype(jnp.int32)])
    return params, state._replace(seen=seen), 0

  key = jax.random.key(7)
  tx = local.periodic(optax.sgd(LR), 3, record, state_type=RecordState, offsets=(0, 2),
                      key=key, axis_name=None,
                      init_fn=lambda p: {"seen": jnp.full(4, -1, jnp.int32)})
  state = tx.init(PARAMS)
  update = jax.jit(lambda s: tx.update(jax.tree.map(jnp.ones_like, PARAMS), s, PARAMS)[1])
  keys = jax.random.key_data(key)
  want = []
  for t in range(1, 7):
    state = update(state)
    if t % 3 in (0, 2):
      keys, sub = jax.random.split(keys)
      want = [t, len([s for s in range(1, t + 1) if s % 3 in (0, 2)]) - 1, [0, 2].index(t % 3),
              int(sub[0].astype(jnp.int32))]
    assert np.asarray(state.seen).tolist() == (want or [-1] * 4), t
  np.testing.assert_array_equal(state.key, keys)  # split once per sync


def test_grad_fn_and_after_fn_by_hand():
  """A proximal term μ (θ_w − θ_anchor) added by grad_fn (FedProx) and a step after the sync
  (after_fn), one device: by hand."""

  class ProxState(NamedTuple):
    count: jax.Array
    inner_state: object
    wire_bytes: jax.Array
    anchor: object  # like params: θ at the last sync

  def proximal(grads, state, params):
    grads = jax.tree.map(lambda g, p, a: g + 0.5 * (p - a), grads, params, state.anchor)
    return grads, state._replace(wire_bytes=comm.add_bytes(state.wire_bytes, 10))

  def reanchor(params, state, info):
    return params, state._replace(anchor=params), 0

  def nudge(params, state):  # after the sync, with count = t: + 0.01 at update 3 only
    return jax.tree.map(lambda x: jnp.where(state.count == 3, x + 0.01, x), params), state

  tx = local.periodic(optax.sgd(LR), 2, reanchor, init_fn=lambda p: {"anchor": p},
                      state_type=ProxState, grad_fn=proximal, after_fn=nudge, axis_name=None)
  params = {"w": jnp.ones(())}
  state = tx.init(params)
  for _ in range(3):
    updates, state = tx.update({"w": jnp.ones(())}, state, params)
    params = optax.apply_updates(params, updates)
  # 1 − 0.1 = 0.9; 0.9 − 0.1 (1 + 0.5 (0.9 − 1)) = 0.805, the new anchor; 0.805 − 0.1 + 0.01.
  np.testing.assert_allclose([params["w"], state.anchor["w"]], [0.715, 0.805], rtol=1e-6)
  assert int(state.wire_bytes) == 30


def test_contract_breaches_fail_clearly():
  params = {"w": jnp.ones(2)}
  grads = {"w": jnp.ones(2)}
  tx = local.periodic(optax.sgd(LR), 1, lambda p, s, i: (p, s._replace(count=s.count + 1), 0),
                      axis_name=None)
  with pytest.raises(ValueError, match=r"sync_fn changed \['count'\]"):
    tx.update(grads, tx.init(params), params)
  tx = local.periodic(optax.sgd(LR), 1, average(None), axis_name=None,
                      after_fn=lambda p, s: (p, s._replace(inner_state=())))
  with pytest.raises(ValueError, match=r"after_fn changed \['inner_state'\]"):
    tx.update(grads, tx.init(params), params)
  tx = local.periodic(optax.sgd(LR), 1, lambda p, s, i: (p, tuple(s), 0), axis_name=None)
  with pytest.raises(ValueError, match="must return its state as a PeriodicState"):
    tx.update(grads, tx.init(params), params)
  with pytest.raises(ValueError, match=r"init_fn returned fields \['outer'\]"):
    local.periodic(optax.sgd(LR), 1, average(None), init_fn=lambda p: {"outer": p},
                   axis_name=None).init(params)
  for kwargs, words in ((dict(sync_every=0), "sync_every"),
                        (dict(sync_fn=None), "sync_fn must be callable"),
                        (dict(state_type=dict), "state_type must be a NamedTuple class"),
                        (dict(state_type=optax.ScaleByAdamState), "must have the fields"),
                        (dict(key=jax.random.key(0), state_type=local.LocalSgdState),
                         r"lacks \['key'\]"),
                        (dict(offsets=(0, 0)), "offsets must be distinct"),
                        (dict(offsets=(3,)), "offsets"),
                        (dict(worker_steps=[1, 2]), "worker_steps"),
                        (dict(worker_weights=[1.0, 0.0]), "worker_weights")):
    args = dict(inner=optax.sgd(LR), sync_every=1, sync_fn=average(None), axis_name=None)
    with pytest.raises(ValueError, match=words):
      local.periodic(**{**args, **kwargs})
