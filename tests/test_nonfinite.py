"""sync.skip_nonfinite: a NaN on one worker skips the step on all of them, state untouched.

Reference: the same trainer fed every batch except the poisoned one. Error memories, the
schedule's outer parameters, momenta and counters must equal that run's, bit for bit.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import faults
from jaxcomm import comm, sync, train

W = 8
STEPS, NAN_STEP, NAN_WORKER = 7, 3, 5


def poisoned(batch_fn):
  """Global batch NAN_STEP gets a NaN in one example of worker NAN_WORKER's share."""
  def fn(t):
    batch = batch_fn(t)
    if t == NAN_STEP:
      x = batch["x"].copy()
      x[NAN_WORKER * len(x) // W] = np.nan
      batch = {**batch, "x": x}
    return batch
  return fn


def bitwise(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


@pytest.mark.parametrize("algo", faults.NONFINITE_METHODS)
def test_nan_on_one_worker_skips_the_step_everywhere(algo, mesh8):
  run = faults.built(algo, STEPS)
  params, batch_fn = run.params, run.batches
  tx = sync.skip_nonfinite(run.optimizer, "data")
  trainer = train.Trainer(run.loss_fn, tx, mesh8, has_aux=run.has_aux)
  state, history = train.fit(trainer, trainer.init(params), poisoned(batch_fn), STEPS,
                             log_every=1, progress=False)
  assert [h["skipped_steps"] for h in history] == [0] * NAN_STEP + [1] * (STEPS - NAN_STEP)
  # The poisoned step sent only the 4-byte agreement; the others also the method's bytes.
  flag_bytes = 7  # one int32 all-reduced: 2 * 7/8 * 4
  assert history[NAN_STEP]["wire_bytes"] == flag_bytes < max(h["wire_bytes"] for h in history)
  chex.assert_tree_all_finite((state.params, state.opt_state.inner_state))

  without, _ = train.fit(trainer, trainer.init(params),
                         lambda t: batch_fn(t if t < NAN_STEP else t + 1), STEPS - 1,
                         progress=False)
  bitwise(state.params, without.params)
  bitwise(state.opt_state.inner_state, without.opt_state.inner_state)
  if algo == "diloco":  # the sync period does not count the skipped step
    assert int(state.opt_state.inner_state.count) == STEPS - 1


def test_without_the_wrapper_the_nan_spreads(mesh8):
  """What the wrapper prevents: one worker's NaN reaches the (replicated) parameters."""
  run = faults.built("dp", NAN_STEP + 1)
  trainer = run.trainer()
  state, _ = train.fit(trainer, trainer.init(run.params), poisoned(run.batches), NAN_STEP + 1,
                       progress=False)
  assert any(np.isnan(np.asarray(x)).any() for x in jax.tree.leaves(state.params))


def test_agreement_bytes_counted_equal_inspect_and_formula(mesh8):
  loss = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
  inner = optax.chain(sync.mean("data"), optax.sgd(0.1))
  trainer = train.Trainer(loss, sync.skip_nonfinite(inner, "data"), mesh8)
  state = trainer.init({"w": jnp.zeros(3)})
  batch = {"x": np.ones((16, 3), np.float32), "y": np.ones((16, 3), np.float32)}
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  flag, grads = 7, 21  # all-reduce of an int32 and of f32[3]: 2 * 7/8 * 4, 2 * 7/8 * 12
  assert report.wire_bytes(conditional=False) == flag   # every step, before the decision
  assert report.wire_bytes(conditional=True) == grads   # only in the branch that applies
  state, m = trainer.step(state, batch)  # (the step consumes the state it is given)
  assert int(m["wire_bytes"]) == flag + grads and int(m["skipped_steps"]) == 0
  bad = {**batch, "x": batch["x"].copy()}
  bad["x"][0, 0] = np.inf
  _, m = trainer.step(state, bad)
  assert int(m["wire_bytes"]) == flag and int(m["skipped_steps"]) == 1


# ------------------------------------------------------------------- contract checks
def _tx():
  return sync.skip_nonfinite(optax.adam(0.1), axis_name=None)


def test_contract_init_on_shapes_and_state_structure():
  params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3, jnp.bfloat16)}
  tx = _tx()
  abstract = jax.eval_shape(tx.init, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  state = tx.init(params)
  chex.assert_trees_all_equal_shapes_and_dtypes(abstract, state)
  for grads in (params, jax.tree.map(lambda x: x * jnp.nan, params)):
    updates, new_state = tx.update(grads, state, params)
    chex.assert_trees_all_equal_structs(new_state, state)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)  # keeps bf16 and f32


def test_contract_jit_does_not_recompile():
  tx = _tx()
  params = {"w": jnp.ones(3)}
  update = jax.jit(tx.update)
  state = tx.init(params)
  for grads in ({"w": jnp.ones(3)}, {"w": jnp.ones(3) * jnp.nan}):
    _, state = update(grads, state, params)
  assert update._cache_size() == 1
  assert int(state.skipped_steps) == 1


def test_contract_converges_on_a_quadratic_inside_scan():
  tx = _tx()
  target = jnp.array([1.0, -2.0, 3.0])

  def step(carry, t):
    params, state = carry
    grads = 2 * (params - target)
    grads = jnp.where(t % 5 == 4, jnp.nan, grads)  # every fifth gradient is broken
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None

  (params, state), _ = jax.lax.scan(step, (jnp.zeros(3), tx.init(jnp.zeros(3))),
                                    jnp.arange(300))
  chex.assert_trees_all_close(params, target, atol=1e-2)
  assert int(state.skipped_steps) == 60
