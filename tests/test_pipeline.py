"""Pipeline schedules (GPipe, 1F1B) on a data=2 x pipeline=4 mesh of 8 devices."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import comm
from jaxcomm import models
from jaxcomm import parallel
from jaxcomm import sync
from jaxcomm import train

S = 4


@pytest.fixture(scope="module")
def mesh():
  return train.make_mesh({"data": 2, "pipeline": S})


def _check_dependencies(sched):
  """Each stage runs F(m) and B(m) once each, after what they depend on."""
  when = {}
  for t, row in enumerate(sched.actions):
    for s, (kind, m) in enumerate(row):
      if kind != parallel.IDLE:
        assert (kind, s, m) not in when
        when[(kind, s, m)] = t
  for s, m in itertools.product(range(sched.num_stages), range(sched.num_microbatches)):
    f, b = when[(parallel.FORWARD, s, m)], when[(parallel.BACKWARD, s, m)]
    assert f < b
    if s:
      assert when[(parallel.FORWARD, s - 1, m)] < f
    if s < sched.num_stages - 1:
      assert when[(parallel.BACKWARD, s + 1, m)] < b


@pytest.mark.parametrize("stages,micro", [(2, 2), (2, 5), (4, 4), (4, 8), (8, 8), (3, 10)])
def test_schedules_bubble_and_live_activations(stages, micro):
  gpipe = parallel.schedule_gpipe(stages, micro)
  one_f_one_b = parallel.schedule_1f1b(stages, micro)
  for sched in (gpipe, one_f_one_b):
    _check_dependencies(sched)
    assert sched.steps == 2 * (micro + stages - 1)
  assert gpipe.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))
  assert one_f_one_b.bubble_fraction == pytest.approx(gpipe.bubble_fraction)
  assert gpipe.live.tolist() == [micro] * stages
  assert one_f_one_b.live.max() <= stages and one_f_one_b.act_slots <= stages


# A toy pipeline whose boundary activations dominate memory: f32[512, 32] per micro-batch.
MB, D = 512, 32
ACT_BYTES = MB * D * 4


def _toy_run(mesh, sched):
  first = lambda p, mb: mb * p["scale"]
  stage = lambda p, x: jnp.tanh(x @ p["w"][0])
  last = lambda p, y, mb: jnp.mean((y - mb) ** 2)
  params = {"scale": jnp.ones((D,)), "w": jax.random.normal(jax.random.key(0), (S, D, D)) / 6}
  specs = {"scale": P(), "w": P("pipeline")}

  def body(p, x):
    loss, grads, busy = parallel.pipeline_run(first, stage, last, comm.varying(p, "data"), x[0],
                                              sched, "pipeline")
    return loss[None], grads, busy[None, None]

  x = jax.random.normal(jax.random.key(1), (2, sched.num_microbatches, MB, D))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data")),
                            out_specs=(P("data"), {"scale": P("data"),
                                                   "w": P(("data", "pipeline"))},
                                       P("data", "pipeline"))))
  compiled = f.lower(params, x).compile()
  return compiled, compiled(params, x)


def test_gpipe_measured_bubble_and_1f1b_memory_bounded_by_stages(mesh):
  temp = {}
  for micro, build in itertools.product((S, 4 * S), (parallel.schedule_gpipe,
                                                      parallel.schedule_1f1b)):
    sched = build(S, micro)
    compiled, (_, _, busy) = _toy_run(mesh, sched)
    # Measured on the devices: every stage worked 2M of the 2(M+S-1) steps.
    measured = 1.0 - np.asarray(busy) / sched.steps
    np.testing.assert_allclose(measured, parallel.bubble_fraction_gpipe(S, micro))
    temp[(sched.name, micro)] = compiled.memory_analysis().temp_size_in_bytes
  # GPipe keeps every micro-batch's activation: one more per extra micro-batch.
  grown = temp[("gpipe", 4 * S)] - temp[("gpipe", S)]
  assert abs(grown - 3 * S * ACT_BYTES) <= ACT_BYTES // 8
  # 1F1B keeps at most S: its compiled peak does not grow with the micro-batch count
  # (by less than an eighth of one activation: a few bytes of schedule bookkeeping).
  assert abs(temp[("1f1b", 4 * S)] - temp[("1f1b", S)]) <= ACT_BYTES // 8
  assert temp[("1f1b", 4 * S)] < temp[("gpipe", 4 * S)] - 2 * S * ACT_BYTES


LM = dict(d_model=16, num_layers=4, num_heads=2, d_ff=32, max_len=16)


@pytest.mark.parametrize("build", [parallel.schedule_gpipe, parallel.schedule_1f1b])
def test_pipelined_lm_step_equals_unpipelined(build, mesh):
  lm = models.TransformerLM(**LM)
  params = jax.jit(lm.init)(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (16, 17), 0, 256))
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(models.lm_loss(lm)))(
      params, {"tokens": tokens})
  micro = S
  sched = build(S, micro)
  staged = models.lm_stage_params(params, S)
  lr = 0.5
  trainer = train.Trainer(models.lm_loss_pipeline(lm, sched),
                          optax.chain(sync.mean("data"), optax.sgd(lr)), mesh,
                          param_specs=models.lm_stage_specs(staged))
  state = trainer.init(staged)
  batch = trainer.shard_batch({"tokens": tokens})
  step = trainer.step_fn(state, batch)
  compiled = step.lower(state, batch).compile()
  new_state, measurements, _ = compiled(state, batch)
  np.testing.assert_allclose(np.mean(measurements["loss"]), ref_loss, rtol=1e-5)
  want = jax.tree.map(lambda p, g: p - lr * g, params, ref_grads)
  got = models.lm_unstage_params(new_state.params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # Bytes on the pipeline axis: the schedule's ppermutes plus the shared-gradient reduction.
  report = comm.parse_hlo(compiled.as_text(), mesh=mesh)
  act = models.lm_pipeline_activation_bytes(lm, 16 // 2 // micro, 16)
  expected = parallel.pipeline_bytes(sched, act, models.lm_shared_bytes(staged))
  # (the Trainer's measurements spend no collective: the grad norm is summed in `step`)
  assert report.wire_bytes(axes=("pipeline",)) == expected


def test_fewer_microbatches_than_stages_fail_before_compile():
  for build in (parallel.schedule_gpipe, parallel.schedule_1f1b):
    with pytest.raises(ValueError, match="num_microbatches"):
      build(4, 3)
  with pytest.raises(ValueError, match="num_layers"):
    models.lm_stage_params({"params": {f"block{i}": {} for i in range(3)}}, 2)
  with pytest.raises(ValueError, match="num_layers"):
    models.lm_loss_pipeline(models.TransformerLM(**LM), parallel.schedule_1f1b(3, 3))
