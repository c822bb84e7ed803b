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


@pytest.mark.slow
def test_executed_work_counts_and_1f1b_memory_bounded_by_stages(mesh):
  temp = {}
  for micro, build in itertools.product((S, 4 * S), (parallel.schedule_gpipe,
                                                      parallel.schedule_1f1b)):
    sched = build(S, micro)
    compiled, (_, _, busy) = _toy_run(mesh, sched)
    # `busy` counts the forward and backward steps each device ran (a count of the table's
    # slots as executed, not a timing): 2M per stage, so the idle fraction of the 2(M+S-1)
    # steps is GPipe's bubble (S-1)/(M+S-1). Wall-clock bubbles are benchmarks' business.
    np.testing.assert_array_equal(np.asarray(busy), 2 * micro)
    idle = 1.0 - np.asarray(busy) / sched.steps
    np.testing.assert_allclose(idle, (S - 1) / (micro + S - 1))
    np.testing.assert_allclose(idle, parallel.bubble_fraction_gpipe(S, micro))
    temp[(sched.name, micro)] = compiled.memory_analysis().temp_size_in_bytes
  # GPipe keeps every micro-batch's activation: one more per extra micro-batch.
  grown = temp[("gpipe", 4 * S)] - temp[("gpipe", S)]
  assert abs(grown - 3 * S * ACT_BYTES) <= ACT_BYTES // 8
  # 1F1B keeps at most S: its compiled peak does not grow with the micro-batch count
  # (by less than an eighth of one activation: a few bytes of schedule bookkeeping).
  assert abs(temp[("1f1b", 4 * S)] - temp[("1f1b", S)]) <= ACT_BYTES // 8
  assert temp[("1f1b", 4 * S)] < temp[("gpipe", 4 * S)] - 2 * S * ACT_BYTES


LM = dict(d_model=16, num_layers=4, num_heads=2, d_ff=32, max_len=16)


@pytest.fixture(scope="module")
def lm_reference():
  """The unpipelined LM's parameters, tokens, loss and gradient (computed once)."""
  lm = models.TransformerLM(**LM)
  params = jax.jit(lm.init)(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (16, 17), 0, 256))
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(models.lm_loss(lm)))(
      params, {"tokens": tokens})
  host = lambda tree: jax.tree.map(np.asarray, tree)
  return lm, host(params), tokens, ref_loss, host(ref_grads)


@pytest.mark.parametrize("build", [parallel.schedule_gpipe, parallel.schedule_1f1b])
@pytest.mark.slow
def test_pipelined_lm_step_equals_unpipelined(build, mesh, lm_reference):
  lm, params, tokens, ref_loss, ref_grads = lm_reference
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
  got = models.lm_unstage_params(jax.tree.map(np.asarray, new_state.params))  # on the host
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # Bytes on the pipeline axis (docs/algorithms.md, pipelines): one boundary activation
  # f32[16 / 2 data workers / M, 16 positions, 16 features] per step in which some stage
  # sends forward, one per step in which some stage sends a gradient back; then the loss
  # (4 bytes) and the shared parameters' gradients all-reduced over the S stages.
  report = comm.parse_hlo(compiled.as_text(), mesh=mesh)
  act = 16 // 2 // micro * 16 * LM["d_model"] * 4
  shared = sum(np.asarray(x).nbytes for x in jax.tree.leaves(staged["shared"]))
  kinds = sched.actions[..., 0]
  sends = int((kinds[:, :-1] == parallel.FORWARD).any(1).sum() +
              (kinds[:, 1:] == parallel.BACKWARD).any(1).sum())
  expected = sends * act + 2 * (S - 1) / S * (4 + shared)
  # (the Trainer's measurements spend no collective: the grad norm is summed in `step`)
  assert report.wire_bytes(axes=("pipeline",)) == expected
  assert parallel.pipeline_bytes(sched, act, shared) == expected
  assert act == models.lm_pipeline_activation_bytes(lm, 16 // 2 // micro, 16)
  assert shared == models.lm_shared_bytes(staged)


def test_pipeline_bytes_helper_equals_hand_literal():
  # GPipe, S = 4, M = 8: stage s runs F(m) at step s + m, so stages 0-2 send activations at
  # steps 0..9 (10 steps) and, mirrored, stages 1-3 send gradients in 10 steps: 20 sends of
  # 1024 bytes, then the f32 loss all-reduced over 4 stages, 2 * 3/4 * 4 = 6 bytes.
  assert parallel.pipeline_bytes(parallel.schedule_gpipe(4, 8), 1024.0) == 20 * 1024 + 6
  assert parallel.pipeline_bytes(parallel.schedule_gpipe(4, 8), 1024.0, 400.0) == \
      20 * 1024 + 606  # + 400 shared gradient bytes: 2 * 3/4 * 404


def test_fewer_microbatches_than_stages_fail_before_compile():
  for build in (parallel.schedule_gpipe, parallel.schedule_1f1b):
    with pytest.raises(ValueError, match="num_microbatches"):
      build(4, 3)
  with pytest.raises(ValueError, match="num_layers"):
    models.lm_stage_params({"params": {f"block{i}": {} for i in range(3)}}, 2)
  with pytest.raises(ValueError, match="num_layers"):
    models.lm_loss_pipeline(models.TransformerLM(**LM), parallel.schedule_1f1b(3, 3))
