"""A population of trials in one program (`Trainer(trials=S)`) equals S separate runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxcomm import codecs
from jaxcomm import data
from jaxcomm import models
from jaxcomm import local
from jaxcomm import sync
from jaxcomm import train

S, STEPS, SEEDS = 3, 4, (11, 12, 13)

METHODS = {
    "dp": lambda: optax.chain(sync.mean("data"), optax.sgd(0.1)),
    "diloco": lambda: local.diloco(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True),
                                   sync_every=2, axis_name="data"),
    "powersgd": lambda: optax.chain(sync.powersgd(1, axis_name="data"), optax.sgd(0.1)),
    "int8_ef": lambda: optax.chain(
        sync.compressed(codecs.uniform(8, stochastic=True), memory="ef", axis_name="data",
                        key=jax.random.key(1)), optax.sgd(0.1)),
}


def loss_fn(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def init_params(key):
  k1, k2 = jax.random.split(key)
  return {"w1": 0.5 * jax.random.normal(k1, (8, 8)), "b1": jnp.zeros(8),
          "w2": 0.5 * jax.random.normal(k2, (8, 2))}


@pytest.fixture(scope="module")
def population():
  """Per trial: initial parameters and STEPS global batches of 16 examples (numpy: the
  tests slice them per trial and step on the host, not by an eager program each)."""
  params = jax.jit(jax.vmap(init_params))(jax.random.split(jax.random.key(0), S))
  kx, ky = jax.random.split(jax.random.key(1))
  batches = {"x": jax.random.normal(kx, (S, STEPS, 16, 8)),
             "y": jax.random.normal(ky, (S, STEPS, 16, 2))}
  return jax.tree.map(np.asarray, (params, batches))


def fold_keys_by_hand(opt_state, seed):
  """One run's codec keys folded with its seed, written out (not `fold_in_trials`)."""
  def one(path, x):
    if any(getattr(k, "name", None) == "key" for k in path) and x.dtype == jnp.uint32:
      flat = x.reshape(-1, 2)
      out = [jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), seed))
             for k in flat]
      return jnp.stack(out).reshape(x.shape)
    return x
  return jax.tree_util.tree_map_with_path(one, opt_state)


def run(trainer, state, batches):
  losses, sent = [], []
  for i in range(STEPS):
    state, m = trainer.step(state, jax.tree.map(lambda b, i=i: b[..., i, :, :], batches))
    losses.append(np.asarray(m["loss"]))
    sent.append(np.asarray(m["wire_bytes"]))
  return np.stack(losses, -1), np.stack(sent, -1), state


@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.slow
def test_population_equals_separate_runs(mesh8, population, name):
  params, batches = population
  pop = train.Trainer(loss_fn, METHODS[name](), mesh8, trials=S)
  state = pop.init(params)
  state = state._replace(opt_state=train.fold_in_trials(state.opt_state, jnp.array(SEEDS)))
  pop_loss, pop_sent, pop_state = run(pop, state, batches)
  assert pop_loss.shape == (S, STEPS) and pop_sent.shape == (S, STEPS)
  assert int(pop_state.step) == STEPS  # one shared counter

  single = train.Trainer(loss_fn, METHODS[name](), mesh8)  # one compiled step for all runs
  for t in range(S):
    one = jax.tree.map(lambda x, t=t: x[t], (params, batches))
    state = single.init(one[0])
    state = state._replace(opt_state=fold_keys_by_hand(state.opt_state, SEEDS[t]))
    loss, sent, end = run(single, state, one[1])
    np.testing.assert_allclose(pop_loss[t], loss, rtol=1e-5, err_msg=f"{name} trial {t}")
    np.testing.assert_array_equal(pop_sent[t], sent, err_msg=f"{name} trial {t}")
    assert sent.sum() > 0
    jax.tree.map(lambda a, b, t=t: np.testing.assert_allclose(a[t], b, rtol=1e-5, atol=1e-6),
                 jax.tree.map(np.asarray, pop_state.params), end.params)
  # The trials differ from each other (else equal trials would hide a mixed-up axis).
  assert not np.allclose(pop_loss[0], pop_loss[1])


def test_population_seeds_change_a_stochastic_codec(mesh8, population):
  """Trials with equal parameters and batches differ only through their folded codec keys."""
  params, batches = population
  same = jax.tree.map(lambda x: np.stack([x[0]] * S), (params, batches))
  pop = train.Trainer(loss_fn, METHODS["int8_ef"](), mesh8, trials=S)
  state = pop.init(same[0])
  seeded = state._replace(opt_state=train.fold_in_trials(state.opt_state, jnp.array(SEEDS)))
  loss, _, _ = run(pop, seeded, same[1])
  assert not np.allclose(loss[0, 1:], loss[1, 1:], rtol=0, atol=0)


def test_population_bad_input(mesh8, population):
  params, _ = population
  tx = METHODS["dp"]()
  with pytest.raises(ValueError, match="trials must be an integer"):
    train.Trainer(loss_fn, tx, mesh8, trials=0)
  with pytest.raises(ValueError, match="one PRNG key per trial"):
    train.Trainer(loss_fn, tx, mesh8, trials=S, key=jax.random.key(0))
  with pytest.raises(ValueError, match="leading trial axis of size 4"):
    train.Trainer(loss_fn, tx, mesh8, trials=4).init(params)
  with pytest.raises(ValueError, match="seeds must be one integer per trial"):
    train.fold_in_trials(params, jnp.arange(2))


@pytest.mark.slow
def test_population_of_nnx_models_and_loss_keys(mesh8):
  """NNX models (dropout streams, per-worker BatchNorm statistics) and one loss key per
  trial: each trial equals its own run."""
  def mlp(seed):
    return models.NnxMLP(64, hidden=(16,), num_classes=10, dropout=0.3, batch_norm=True,
                         rngs=nnx.Rngs(params=seed, dropout=seed + 1))

  def loss(model, batch, key):  # the key doubles the loss of some workers at some steps
    value, aux = models.nnx_classifier_loss(model, batch)
    return value * (1 + jax.random.bernoulli(key)), aux

  graphdef, first = nnx.split(mlp(0))
  stacked = nnx.merge(graphdef, jax.tree.map(lambda a, b: jnp.stack([a, b]), first,
                                             nnx.split(mlp(5))[1]))
  keys = jax.random.split(jax.random.key(7), 2)
  ds = data.digits()
  batches = [ds.batch(t, 64) for t in range(2)]
  tx = optax.chain(sync.mean("data"), optax.adam(1e-2, eps=1e-4))
  pop = train.Trainer(loss, tx, mesh8, has_aux=True, trials=2, key=keys)
  state = pop.init(stacked)
  for batch in batches:
    state, m = pop.step(state, jax.tree.map(lambda x: np.stack([x, x[::-1]]), batch))
  for t, seed in enumerate((0, 5)):
    single = train.Trainer(loss, tx, mesh8, has_aux=True, key=keys[t])
    one = single.init(mlp(seed))
    for batch in batches:
      one, m1 = single.step(one, jax.tree.map(lambda x, t=t: x[::-1] if t else x, batch))
    np.testing.assert_allclose(np.asarray(m["loss"])[t], m1["loss"], rtol=1e-5)
    for got, want in ((state.params, one.params),
                      (state.model_state["BatchNorm_0"], one.model_state["BatchNorm_0"])):
      jax.tree.map(lambda a, b, t=t: np.testing.assert_allclose(np.asarray(a)[t], b, rtol=1e-5,
                                                                atol=1e-6), got, want)
