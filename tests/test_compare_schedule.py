"""experiments.compare's learning-rate schedule (config.compare.schedule): the
schedule-free inner optimiser against the recurrence written out by hand on a quadratic,
its evaluation parameters (per leaf and from ACCO's flat shards), the held-out loss read at
them, bad values refused, the report saying which schedule ran; warmup-stable-decay's rate
by hand, and a decay branched from a kept stable state against the whole schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax import contrib

from experiments.compare import settings as compare_settings
from experiments.compare import trials as compare_trials
from experiments.compare import wsd as wsd
from experiments.compare import report as report
from experiments.compare import schedule as schedule
from experiments import build
from experiments import compare
from experiments.configs import compare as compare_config

TINY = compare_config.get_config()
TINY.steps = 4
TINY.data.update(batch_size=16, seq_len=16)
TINY.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
TINY.compare.update(compute_repeats=1, max_steps=4, seeds=1, eval_every=2, eval_batch=8,
                    links=("wan",))


def _free(config=TINY, warmup=0):
  c = config.copy_and_resolve_references()
  c.compare.update(schedule="schedule_free", warmup_steps=warmup)
  return c


def test_schedule_free_sgd_follows_the_hand_recurrence_on_a_quadratic():
  c = _free(warmup=3)
  c.optimizer.update(name="sgd", lr=0.1)
  tx = build.inner_optimizer(compare_settings.method_config(c, {"method": "dp"}))
  a = np.array([1.0, 3.0, 0.5])  # f(w) = sum(a w^2) / 2, gradient a w
  w0 = np.array([1.0, -2.0, 4.0])
  params = {"w": jnp.asarray(w0, jnp.float32)}
  state = tx.init(params)
  # By hand (Defazio et al. 2024), step t = 1, 2, ...: the warmup lr(s) = 0.1 min(s / 3, 1);
  # the gradient step uses lr(t - 1) (the base SGD counts from 0), the averaging weight
  # c_t = m_t^2 / sum of m_s^2 with m_t = max of lr(1..t) (optax's counter starts at 1);
  # z -= lr(t - 1) grad(y), x = (1 - c_t) x + c_t z, y = 0.9 x + 0.1 z; evaluate at x.
  y, z, x, top, total = w0.copy(), w0.copy(), w0.copy(), 0.0, 0.0
  for t in range(1, 7):
    top = max(top, 0.1 * min(t / 3, 1.0))
    total += top ** 2
    ct = top ** 2 / total
    z = z - 0.1 * min((t - 1) / 3, 1.0) * a * y
    x = (1 - ct) * x + ct * z
    y = 0.9 * x + 0.1 * z
    updates, state = tx.update({"w": jnp.asarray(a, jnp.float32) * params["w"]}, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
    np.testing.assert_allclose(params["w"], y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(schedule.eval_params(params, (state,))["w"], x, rtol=1e-5,
                               atol=1e-6)
  assert not np.allclose(x, y)  # the evaluation point is not the gradient's


def test_adamw_becomes_schedule_free_adamw_and_constant_leaves_it_alone():
  free = build.inner_optimizer(compare_settings.method_config(_free(warmup=2), {"method": "dp"}))
  state = free.init({"w": jnp.ones(2)})
  assert isinstance(state, contrib.ScheduleFreeState)
  ref = contrib.schedule_free_adamw(TINY.optimizer.lr, warmup_steps=2,
                                    weight_decay=TINY.optimizer.weight_decay)
  g, p = {"w": jnp.array([0.5, -1.0])}, {"w": jnp.ones(2)}
  np.testing.assert_array_equal(free.update(g, state, p)[0]["w"],
                                ref.update(g, ref.init(p), p)[0]["w"])
  const = compare_settings.method_config(TINY, {"method": "dp"})
  assert "schedule" not in const.optimizer
  assert not isinstance(build.inner_optimizer(const).init(p), contrib.ScheduleFreeState)


def test_evaluation_parameters_from_flat_worker_shards_with_a_trial_axis():
  rng = np.random.default_rng(0)
  y = {"a": rng.normal(size=(2, 2, 3)), "b": rng.normal(size=(2, 4))}  # 2 trials, 10 values
  za, zb = rng.normal(size=(2, 2, 3)), rng.normal(size=(2, 4))
  # ACCO's z: the parameters flattened in leaf order, zero-padded to 12 and split over 4
  # workers, per trial.
  flat = np.concatenate([za.reshape(2, 6), zb, np.zeros((2, 2))], axis=1).reshape(2, 4, 3)
  state = contrib.ScheduleFreeState(b1=jnp.full((2,), 0.9), weight_sum=0, step_count=1,
                                    max_lr=0, base_optimizer_state=(), z=flat)
  x = schedule.eval_params(y, {"inner": state})
  np.testing.assert_allclose(x["a"], (y["a"] - 0.1 * za) / 0.9, rtol=1e-5)
  np.testing.assert_allclose(x["b"], (y["b"] - 0.1 * zb) / 0.9, rtol=1e-5)
  with pytest.raises(ValueError, match="cannot be read"):
    schedule.eval_params(y, {"inner": state._replace(z=np.zeros((3, 4, 3)))})


def test_every_catalogue_method_with_an_inner_optimiser_is_schedule_free():
  c = _free()
  for label in ("acco", "diloco_h10"):  # a flat ZeRO-1 shard; per-worker inner states
    run = build.build(compare_settings.method_config(c, compare.METHODS[label]))
    state = run.trainer().init(run.params)
    leaves = jax.tree.leaves(state.opt_state,
                             is_leaf=lambda s: isinstance(s, contrib.ScheduleFreeState))
    assert any(isinstance(s, contrib.ScheduleFreeState) for s in leaves), label
    # At the start x = y: a wrong flattening order or axis would not give the parameters.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 schedule.eval_params(state.params, state.opt_state), state.params)


@pytest.mark.slow
def test_the_held_out_loss_is_read_at_the_evaluation_parameters():
  c = _free()
  config = compare_settings.method_config(c, compare.METHODS["dp_bf16"])
  heldout = compare_trials.heldout_fn(config)
  pop = compare_trials.Population("dp_bf16", 0, [config], compare_settings.links(config),
                                  heldout, False)
  pop.train_to(2)
  state = pop.states[0]
  (free,) = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(
      s, contrib.ScheduleFreeState)) if isinstance(s, contrib.ScheduleFreeState)]
  x = contrib.schedule_free_eval_params(free, state.params)
  assert pop.trials[0].evals == [(2, pytest.approx(float(heldout(x)), rel=1e-6))]
  assert float(heldout(x)) != float(heldout(state.params))


def test_bad_schedules_are_refused_and_the_report_names_the_one_that_ran(tmp_path):
  for key, value, words in (("schedule", "cosine", "schedule must be one of 'constant', "
                             "'schedule_free', 'wsd'; got 'cosine'"),
                            ("warmup_steps", -1, "warmup_steps"),
                            ("decay_fraction", 1.0, "decay_fraction must be a finite number in "
                             r"\(0, 1\), got 1.0")):
    c = TINY.copy_and_resolve_references()
    c.compare[key] = value
    with pytest.raises(ValueError, match=words):
      compare.run(c, str(tmp_path), ["dp"], verbose=False)
  c = TINY.copy_and_resolve_references()
  c.optimizer.schedule = "cosine"
  with pytest.raises(ValueError, match="optimizer.schedule must be one of"):
    build.inner_optimizer(c)
  heading = report._heading
  assert "constant learning rate" in heading(TINY, [{"workers": 8}], 2.0, "given")
  assert "schedule-free inner optimiser (warmup 5 steps" in heading(
      _free(warmup=5), [{"workers": 8}], 2.0, "given")
  wsd = TINY.copy_and_resolve_references()
  wsd.compare.update(schedule="wsd", decay_fraction=0.25)
  assert "warmup-stable-decay (warmup 0 steps; the trials are the stable phase, a decay " \
      "over the last 0.25 of each budget" in heading(wsd, [{"workers": 8}], 2.0, "given")


# ---------------------------------------------------------------- warmup-stable-decay
def test_the_wsd_rate_by_hand():
  """Warmup over 2 updates, stable, then from update 4 a linear fall over 4 updates (1 of
  them: half the rate, not a full-rate step)."""
  f = build.wsd_schedule(0.1, warmup=2, decay_start=4, decay_steps=4)
  np.testing.assert_allclose([float(f(c)) for c in range(9)],
                             [0.05, 0.1, 0.1, 0.1, 0.08, 0.06, 0.04, 0.02, 0.0], rtol=1e-6)
  one = build.wsd_schedule(0.1, warmup=0, decay_start=7, decay_steps=1)
  assert [float(one(c)) for c in (6, 7, 8)] == [pytest.approx(0.1), pytest.approx(0.05), 0.0]
  stable = build.wsd_schedule(0.1, warmup=0, decay_start=None, decay_steps=None)
  assert [float(stable(c)) for c in (0, 100)] == [pytest.approx(0.1)] * 2


@pytest.mark.slow
def test_a_decay_branched_from_the_stable_state_equals_the_whole_schedule_from_scratch():
  """The stable phase trained once, its state kept at step 4 (the first step whose clock
  reaches the watched seconds), a 3-step decay branched from it: the same held-out loss
  as training warmup-stable-decay with the decay at update 4 from the start."""
  c = TINY.copy_and_resolve_references()
  c.compare.update(schedule="wsd", warmup_steps=2)
  config = compare_settings.method_config(c, compare.METHODS["dp"])
  links = compare_settings.links(config)
  heldout = compare_trials.heldout_fn(config)
  pop = compare_trials.Population("dp", 0, [config], links, heldout, False)
  clock = lambda trial, link: (1.0, None)  # noqa: E731 (1 s a step plus DP's bytes)
  pop.evaluate_on(clock, {"wan": 100.0})
  pop.train_to(1)
  per_step = float(pop.trials[0].clocks(clock)["wan"].known[0])
  pop.watch = {"wan": 3.5 * per_step}  # reached at step 4
  pop.train_to(7)  # the stable phase goes on past the branch point
  step, states = pop.snapshots["wan"]
  assert step == 4 and wsd._updates(states[0].opt_state) == 4
  losses, stable, decayed = wsd.decay(pop, step, states, 3)
  assert decayed
  whole = config.copy_and_resolve_references()
  with whole.unlocked():
    whole.optimizer.update(decay_start=4, decay_steps=3)
  scratch = compare_trials.Population("dp", 0, [whole], links, heldout, False)
  scratch.train_to(7)
  np.testing.assert_allclose(losses, scratch.evaluate(scratch.trainers[0], scratch.states[0]),
                             rtol=1e-5)
  # The stable rate over the same 3 steps from the kept state is the stable phase's step 7.
  np.testing.assert_allclose(stable, pop.evaluate(pop.trainers[0], pop.states[0]), rtol=1e-5)
  assert not np.allclose(losses, stable, rtol=1e-4)
