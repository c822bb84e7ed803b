"""jaxcomm.plan and experiments/plan.py: a step at real size, compiled but never allocated.

* At the make-run LM's size (which also runs for real on the 8 devices) the plan's
  collectives, memory analysis and counted bytes per step equal a real step's, and its
  predicted step time equals jaxcomm.sim's for the same inputs.
* At GPT-2 small's widths (the preset's parameter count; 2 of its 12 blocks compiled): DP's,
  PowerSGD rank 4's and ZeRO-3's bytes and memory against literals derived by hand from the
  parameter shapes.
* Bad input is a ValueError naming the argument before anything compiles.
* Memory: a step whose peak is over the device's memory is flagged with its excess; every
  remat policy keeps the LM's loss and gradient, and rematerialised blocks lower the peak.
* A llama_1b plan on 64 emulated devices (a subprocess): DP's bytes follow the all-reduce
  law at W = 64, the process's peak memory stays far below the model's size, and the step's
  peak is flagged over the h100's memory.
"""

import json
import math
import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import build
from experiments import config
from experiments import plan as plan_cli
from experiments.configs import compare as compare_config
from jaxcomm import comm, models, parallel, plan, sim, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6


def _memory_fields(compiled) -> plan.Memory:
  m = compiled.memory_analysis()
  return plan.Memory(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                     aliased=m.alias_size_in_bytes, temp=m.temp_size_in_bytes)


# ---------------------------------------------------------------- plan == a real step
@pytest.mark.parametrize("method,settings,mesh", [
    ("dp", {}, "data=8"),
    # Two fragments synced in turn, each merged 2 steps later (overlap on the clock).
    ("streaming_diloco", {"sync_every": 4, "fragments": 2, "overlap": 2}, "data=8"),
    # The sync crosses replicas (conditional), ZeRO-3 gathers inside them (every step).
    ("diloco", {"sync_every": 3}, "replica=2,fsdp=4"),
])
@pytest.mark.slow
def test_plan_equals_a_real_step_at_the_make_run_size(method, settings, mesh):
  c = config.with_method(compare_config.get_config(), {"method": method, **settings})
  with c.unlocked():
    c.mesh, c.steps = mesh, STEPS
  # The real run: its compiled step, and the bytes its counters count at each step.
  real = build.build(c)
  trainer = real.trainer()
  state = trainer.init(real.params)
  batch = trainer.shard_batch(real.batches(0))
  # Compiled as the planner compiles (optimisation barriers kept, `plan.compile_step`).
  compiled = trainer.step_fn(state, batch).lower(state, batch).compile(
      compiler_options={"xla_disable_hlo_passes": "cse_barrier_expander"})
  real_report = comm.parse_hlo(compiled.as_text(), mesh=trainer.mesh)
  counted = []
  for t in range(STEPS):  # the compiled step itself (train.fit would compile it again)
    state, _, sent = compiled(state, trainer.shard_batch(real.batches(t)))
    counted.append(float(sent))
  counted = np.array(counted)
  # The plan: nothing initialised.
  abstract = build.build(c, abstract=True)
  step = plan.compile_step(abstract.trainer(), abstract.params, abstract.batches(0),
                           steps=STEPS)

  assert step.report.by_axis() == real_report.by_axis()
  assert step.report.wire_bytes(conditional=True) == \
      real_report.wire_bytes(conditional=True)
  assert step.memory == _memory_fields(compiled)
  assert step.memory.arguments == sum(step.state_bytes.values())
  np.testing.assert_array_equal(step.schedule, counted)
  if method != "dp":  # the counters ran: which steps sync came from them
    assert step.counted is not None and step.report.wire_bytes(conditional=True) > 0
  # Bytes per axis: every-step collectives in full, the sync's once per sync_every steps.
  every = {a: real_report.wire_bytes(axes=a, conditional=False) for a in real_report.by_axis()}
  cond = {a: sum(x.total_bytes for x in real_report.select(axes=a, conditional=True))
          for a in real_report.by_axis()}
  fraction = np.mean(np.clip(counted - real_report.wire_bytes(conditional=False), 0, None)) / \
      max(real_report.wire_bytes(conditional=True), 1)
  for axes, value in step.bytes_per_axis().items():
    assert value == pytest.approx(every[axes] + cond[axes] * fraction, rel=1e-12)
  # The predicted step time is jaxcomm.sim's clock on the real run's counted bytes.
  overlap = build.hooks(c.method.name).overlap_steps(c.method)
  topology = {a: "wan" if i == 0 else "nvlink" for i, a in enumerate(trainer.mesh.axis_names)}
  expected = sim.simulate(0.01, sim.comm_seconds_per_step(
      counted, comm.cost(real_report, topology)), overlap_steps=overlap)
  predicted = plan.predict(step, topology, 0.01, overlap_steps=overlap)
  assert predicted.step == pytest.approx(expected.total / STEPS, rel=1e-12)
  assert predicted.exposed == pytest.approx(expected.exposed_comm / STEPS, rel=1e-12)


# ---------------------------------------------------------------- GPT-2 small's shape
# Parameters of the LM at GPT-2 small's shape (d = 768, 12 layers, 12 heads, d_ff = 3072,
# vocab V = 50257, context 1024; untied head), by hand:
#   embedding V d = 38,597,376; positions 1024 d = 786,432
#   block: 2 LayerNorms 4 d = 3,072; qkv d 3d + 3d = 1,771,776; proj d d + d = 590,592;
#          fc_in d 4d + 4d = 2,362,368; fc_out 4d d + d = 2,360,064  -> 7,087,872; x 12
#   final LayerNorm 2 d = 1,536; head d V + V = 38,647,633
GPT2_PARAMS = 38_597_376 + 786_432 + 12 * 7_087_872 + 1_536 + 38_647_633
assert GPT2_PARAMS == 163_087_441
# The plans below compile GPT-2 small's widths with BLOCKS = 2 of its 12 blocks: every
# block is the same leaves, so each law below holds per block (a 12-block step is six
# times the program to compile, for the same checks).
BLOCKS = 2
PARAMS = 38_597_376 + 786_432 + BLOCKS * 7_087_872 + 1_536 + 38_647_633
assert PARAMS == 92_208_721


def test_the_gpt2_preset_has_gpt2_small_parameters():
  base = plan_cli.model_config(config.base_config("dp"), "gpt2_124m", "data=8")
  run = build.build(base, abstract=True)  # shapes only: nothing compiles
  assert sum(math.prod(x.shape) for x in jax.tree.leaves(run.params)) == GPT2_PARAMS


@pytest.fixture(scope="module")
def gpt2():
  """plan_one(method entry) -> StepPlan of GPT-2 small's widths (BLOCKS blocks) on 8 devices
  (each compiled once for the module)."""
  base = plan_cli.model_config(config.base_config("dp"), "gpt2_124m", "data=8")
  with base.unlocked():
    base.model.num_layers = BLOCKS
  done = {}

  def plan_one(entry):
    key = json.dumps(entry, sort_keys=True)
    if key not in done:
      run = build.build(config.with_method(base, entry), abstract=True)
      assert sum(math.prod(x.shape) for x in jax.tree.leaves(run.params)) == PARAMS
      done[key] = plan.compile_step(run.trainer(), run.params, run.batches(0), steps=2)
    return done[key]
  return plan_one


def test_gpt2_dp_sends_the_ring_allreduce_of_every_parameter(gpt2):
  step = gpt2({"method": "dp"})
  # 2 (W - 1) / W x 4 bytes x 92,208,721 parameters at W = 8: 7 x 92,208,721.
  assert step.bytes_per_step() == 645_461_047
  assert step.bytes_per_axis() == {("data",): 645_461_047}
  assert step.counted is None and not step.why_not_counted  # no conditional collective


def test_gpt2_powersgd_rank4_sends_its_factors(gpt2):
  # Each tensor is a matrix of its first k dimensions x the rest, k sending the least (a
  # layer's inputs x outputs), oriented shorter side n first; rank r = 4; it travels as P
  # (n r floats) and Q (m r floats) when (n + m) r x 2 < n m, else whole (vectors always):
  #   embedding 50257 x 768 and head 768 x 50257: (768 + 50257) 4 = 204,100 each
  #   positions 1024 x 768: (768 + 1024) 4 = 7,168
  #   per block: qkv 768 x (3 12 64): (768 + 2304) 4 = 12,288 (as (768 3 12) x 64 it was
  #     (64 + 27648) 4 = 110,848); qkv bias (3 12) x 64: (36 + 64) 4 = 400 (3 x 768 would
  #     be 3 x 771 at rank 3); proj (12 64) x 768: 1536 x 4 = 6,144; fc_in 768 x 3072 and
  #     fc_out 3072 x 768: 3840 x 4 = 15,360 each -> 49,552, x 2 blocks = 99,104
  #   whole: per block 2 LayerNorms 3,072 + proj, fc_in, fc_out biases 768 + 3,072 + 768
  #     = 7,680, x 2 = 15,360; final LayerNorm 1,536; head bias 50,257
  floats = 2 * 204_100 + 7_168 + 99_104 + 15_360 + 1_536 + 50_257
  assert floats == 581_625
  step = gpt2({"method": "powersgd", "rank": 4})
  # Two ring all-reduces (P with the whole tensors, then Q): 2 x 7/8 x 4 bytes per float.
  assert step.bytes_per_step() == 7 * 581_625 == 4_071_375


def test_gpt2_zero3_holds_one_eighth_of_dp_parameters(gpt2):
  dp = gpt2({"method": "dp"})
  zero3 = gpt2({"method": "dp", "mesh": "fsdp=8"})
  for step in (dp, zero3):  # the parts add up to XLA's memory analysis of the arguments
    assert sum(step.state_bytes.values()) == step.memory.arguments
  assert dp.state_bytes["params"] == 4 * PARAMS
  # The layout's rules shard every matrix (and the proj / fc_out biases) over fsdp along
  # its d = 768 = 8 x 96 dimension; the vectors of other dimensions stay whole on every
  # device: per block 2 LayerNorms 3,072, the qkv bias 2,304 and the fc_in bias 3,072
  # (8,448, x 2 blocks = 16,896), the final LayerNorm 1,536 and the head bias 50,257.
  whole = 16_896 + 1_536 + 50_257
  assert zero3.state_bytes["params"] == 4 * ((PARAMS - whole) // 8 + whole) == 46_344_772
  assert zero3.state_bytes["params"] < 1.01 * dp.state_bytes["params"] / 8
  # AdamW's moments are sharded like the parameters.
  assert zero3.state_bytes["opt_state"] <= 2 * zero3.state_bytes["params"] + 64
  assert zero3.memory.arguments < 1.01 * dp.memory.arguments / 8


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,words", [
    (dict(model="gpt5"), "model must be one of 'gpt2_124m'"),
    (dict(mesh="data=3"), "mesh 'data=3' has 3 devices, which does not divide the 8"),
    (dict(mesh="data=two"), "mesh 'data=two'"),
    (dict(mfu=-0.2), "mfu must be a number in (0, 1]"),
    (dict(device="tpu_v9"), "device must be one of 'a100'"),
    (dict(links=["lan"]), "links: 'lan' is not a link preset"),
    (dict(inner_link="pcie"), "inner_link: 'pcie' is not a link preset"),
    (dict(methods=["dp", "nope"]), "methods must be one of 'dp', "),
    (dict(compute_seconds=-1.0), "compute_seconds must be a finite number >= 0"),
    (dict(batch_per_device=0), "batch_per_device must be an integer >= 1"),
    (dict(steps=0), "steps must be an integer >= 1"),
    (dict(model="resnet18", mesh="data=2,tensor=4"), "lays out"),
    # absl splits --links=mydc:gbit=10,latency_ms=30 at the comma: the error says where to go.
    (dict(links=["mydc:gbit=10", "latency_ms=30"]),
     "A link of your own goes in --link=name:gbit=G,latency_ms=L"),
    (dict(links=["wan"], link=["a:gbit=1,latency_ms=1", "a:gbit=2,latency_ms=5"]),
     "the name 'a' is given twice"),
    (dict(link=["mydc:gbit=ten,latency_ms=30"]), "gbit must be a number"),
    (dict(remat=["blocks"]), "remat must be distinct names out of none, block, dots_saveable"),
    (dict(model="resnet18", remat=["block"]), "remat applies to the LM"),
])
def test_bad_input_names_the_argument_before_anything_compiles(kwargs, words, tmp_path,
                                                               monkeypatch):
  def compiled(*args, **kw):
    raise AssertionError("compiled before the input was checked")
  monkeypatch.setattr(plan, "compile_step", compiled)
  with pytest.raises(ValueError, match=re.escape(words)):
    plan_cli.run(config.base_config("dp"), str(tmp_path), verbose=False,
                 **{"model": "gpt2_124m", **kwargs})


def test_a_misspelt_method_setting_is_named():
  with pytest.raises(ValueError, match="method 'diloco' has no setting 'sync_evry'"):
    config.with_method(config.base_config(), {"method": "diloco", "sync_evry": 10})
  with pytest.raises(ValueError, match="config.optimizer has no setting 'learning_rate'"):
    config.with_method(config.base_config(), {"method": "dp",
                                              "optimizer": {"learning_rate": 1.0}})


# ---------------------------------------------------------------- memory and remat
TINY_LM = dict(d_model=64, num_layers=4, num_heads=4, d_ff=256)


@pytest.mark.slow
def test_remat_keeps_the_lm_s_loss_and_gradient():
  """Every policy computes the same loss and gradient; what it keeps differs (below)."""
  tokens = jnp.arange(2 * 9).reshape(2, 9) % 11
  sizes = dict(d_model=16, num_layers=2, num_heads=2, d_ff=32, max_len=8)
  params = models.TransformerLM(**sizes).init(jax.random.key(0), tokens[:, :-1])
  out = {}
  for policy in ("none", "block", "dots_saveable"):
    lm = models.TransformerLM(**sizes, remat=policy)
    out[policy] = jax.jit(jax.value_and_grad(models.lm_loss(lm)))(params, {"tokens": tokens})
  for policy in ("block", "dots_saveable"):
    chex.assert_trees_all_close(out[policy], out["none"], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="remat must be one of 'none', 'block'"):
    models.TransformerLM(remat="layer")


@pytest.mark.slow
def test_a_step_over_the_device_memory_is_flagged_with_the_remat_that_fits(tmp_path):
  """DP on the LM (4 blocks, 8 x 128 tokens) planned without and with each block
  rematerialised, on a device of 38 MB: XLA:CPU's peak is about 57 MB without (every
  block's attention probabilities, 8 x 4 x 128 x 128 floats = 2 MB each, are kept for the
  backward pass) and about 19 MB with (only each block's input): the first is flagged with
  its excess, the note says which policy fits. Links of one's own are planned too."""
  c = config.base_config("dp")
  with c.unlocked():
    c.model.update(TINY_LM)
    c.data.seq_len, c.data.batch_size = 128, 8
  device = plan.Device(1e12, 1e12, 38e6, name="small")
  summary = plan_cli.run(c, str(tmp_path), mesh="data=1", methods=["dp"], links=["wan"],
                         link=["mydc:gbit=10,latency_ms=30"], device=device,
                         remat=["none", "block"], steps=2, verbose=False, figure=False)
  rows = {r["method"]: r for r in summary["methods"]}
  assert list(rows) == ["dp (none)", "dp (block)"] and summary["remat"] == ["none", "block"]
  for r in rows.values():
    peak = r["memory"]["peak"]
    assert r["fits_hbm"] == (peak <= 38e6) and r["hbm_over_bytes"] == max(0, peak - 38e6)
  none, block = rows["dp (none)"], rows["dp (block)"]
  assert not none["fits_hbm"] and block["fits_hbm"]
  assert none["memory"]["peak"] > 2 * block["memory"]["peak"]
  assert block["flops"] > none["flops"]  # the blocks' forward passes, computed twice
  assert f"| no: +{plan_cli._bytes(none['hbm_over_bytes'])} |" in summary["table"]
  assert (f"* dp: +{plan_cli._bytes(none['hbm_over_bytes'])} with remat none; fits with "
          "remat block") in summary["table"]
  # 10 Gbit/s = 1.25e9 bytes/s per direction, 30 ms per message.
  assert summary["links"]["mydc"]["bandwidth"] == 1.25e9
  assert summary["links"]["mydc"]["latency"] == 0.03
  assert set(none["links"]) == {"wan", "mydc"}


# ---------------------------------------------------------------- the counter machine
def _tiny_program(tx, params):
  mesh = parallel.make_mesh({"data": 8})
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  return train.make_program(loss, tx, mesh, params)


def _tiny_step(tx, steps=5):
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {"w": f32(16, 4)}
  return plan.compile_step(_tiny_program(tx, params), params, {"x": f32(8, 16)}, steps=steps)


def sync_if_large(axis_name="data"):
  """A transform that averages the gradient over workers only when its global norm is above
  1 (counted in that branch): which steps send depends on values."""
  def init(params):
    del params
    return {"wire_bytes": comm.zero_bytes()}

  def update(grads, state, params=None):
    del params
    norm, _ = comm.sum(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)), axis_name)

    def send(g, counter):
      g, nbytes = comm.mean(g, axis_name)
      return g, comm.add_bytes(counter, nbytes)

    grads, counter = comm.cond(norm > 1.0, send, lambda g, counter: (g, counter), grads,
                               state["wire_bytes"])
    return grads, {"wire_bytes": counter}
  return optax.GradientTransformation(init, update)


def test_the_counter_machine_refuses_a_schedule_that_depends_on_values():
  step = _tiny_step(optax.chain(sync_if_large(), optax.sgd(0.1)))
  assert step.report.wire_bytes(conditional=True) > 0
  assert step.counted is None and "depends on" in step.why_not_counted
  # Then every conditional collective is charged at every step: an upper bound.
  np.testing.assert_array_equal(step.schedule, np.full(5, step.report.wire_bytes()))


def test_the_counter_machine_refuses_to_hold_more_than_its_limit():
  from jaxcomm.plan import _schedule
  from jaxcomm import local
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {"w": f32(16, 4)}
  program = _tiny_program(local.diloco(optax.sgd(0.1), optax.sgd(0.7), sync_every=2), params)
  state = plan.abstract_state(program, params)
  batch = plan.abstract_batch(program, {"x": f32(8, 16)})
  report = comm.parse_hlo(program.step.lower(state, batch).compile().as_text(),
                          mesh=program.config.mesh)
  counted, why = _schedule.counted_bytes(program, params, state, batch, 4, report)
  np.testing.assert_array_equal(counted, [0, 448, 0, 448])  # 2 x 7/8 x 4 x 64 every 2nd
  counted, why = _schedule.counted_bytes(program, params, state, batch, 4, report, limit=0)
  assert counted is None and "would hold" in why


def test_counts_past_4_gib_are_unwrapped_with_the_compiled_branches():
  def col(nbytes, branch):
    return comm.Collective("all-reduce", "f32", (1,), ("data",), 8, nbytes, nbytes,
                           bool(branch), 1, "x", branch=branch)
  # 3 GB every step, a 5 GB sync in one branch and a 2 GB one in another; counters round
  # each addition to whole bytes, so a count may sit a few bytes off the compiled sum.
  report = comm.CollectiveReport((col(3e9, ""), col(5e9, "sync"), col(2e9, "other")))
  true = np.array([3e9, 8e9 - 3, 5e9 + 2, 10e9])
  unwrapped, why = plan.unwrap(true % 2 ** 32, report)
  assert not why
  np.testing.assert_array_equal(unwrapped, true)
  # A count that matches no sum of the program's every-step and branch bytes is refused.
  unwrapped, why = plan.unwrap(np.array([3e9 + 2 ** 30]), report)
  assert unwrapped is None and "match no sums" in why


# ---------------------------------------------------------------- prediction
def test_the_crossover_is_where_the_step_times_meet():
  # DP: compute c and B_dp bytes; a method: c + d and B_m bytes: equal at (B_dp - B_m) / d.
  c, d, b_dp, b_m = 0.1, 0.02, 8e9, 1e9
  b = plan.crossover(lambda x: c + d + b_m / x, lambda x: c + b_dp / x)
  assert b == pytest.approx((b_dp - b_m) / d, rel=2e-3)
  assert plan.crossover(lambda x: c + b_m / x, lambda x: c + b_dp / x) == math.inf
  assert plan.crossover(lambda x: c + b_dp / x, lambda x: c + b_m / x) is None


def test_prediction_charges_a_sync_once_per_period():
  # A DiLoCo-like schedule: 7 KB every 4th step, no overlap: the run is 4 steps of compute
  # and one sync per period.
  sync = comm.Collective("all-reduce", "f32", (1000,), ("data",), 8, 4000, 7000, True, 1, "x",
                         branch="sync")
  step = plan.StepPlan(comm.CollectiveReport((sync,)), None, 0.0, 0.0, {},
                       np.array([0, 0, 0, 7000.0] * 25), "", {"data": 8}, 100)
  link = comm.Link(1e6, 0.0)
  p = plan.predict(step, link, 0.01, algorithm="ring")
  assert p.step == pytest.approx(0.01 + 7000 / 1e6 / 4)
  assert p.comm == pytest.approx(7000 / 1e6 / 4)


# ---------------------------------------------------------------- the command line
def test_abstract_builds_give_batch_shapes_without_loading_them():
  c = plan_cli.model_config(config.base_config("dp"), "resnet50", "data=8")
  run = build.build(c, abstract=True)
  assert run.batches(0) == {"x": jax.ShapeDtypeStruct((256, 224, 224, 3), jnp.float32),
                            "y": jax.ShapeDtypeStruct((256,), jnp.int32)}
  # torchvision's resnet50 has 25,557,032 parameters (GroupNorm: the same count).
  assert sum(math.prod(x.shape) for x in jax.tree.leaves(run.params)) == 25_557_032


@pytest.mark.slow
def test_a_1b_plan_on_64_emulated_devices_allocates_nothing_of_its_size(tmp_path):
  """The command line at data=64 (emulated), DP only: the bytes follow the ring law at
  W = 64, and the planning process's peak memory is a fraction of one device's state."""
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("XLA_FLAGS", None)
  # The planner runs under a parent of its own, whose only child it is: that parent's
  # RUSAGE_CHILDREN is the planner's peak (this test process's would include every
  # subprocess an earlier test started in this worker).
  measure = ("import resource, subprocess, sys; "
             "code = subprocess.run(sys.argv[1:]).returncode; "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")
  proc = subprocess.run(
      [sys.executable, "-c", measure, sys.executable, "-m", "experiments.plan",
       "--model=llama_1b", "--mesh=data=64", "--methods=dp", "--links=wan", "--steps=4",
       f"--workdir={tmp_path}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  peak_rss = int(proc.stdout.split()[-1]) * 1024  # Linux: KiB
  with open(tmp_path / "plan.json", encoding="utf-8") as f:
    summary = json.load(f)
  (dp,) = summary["methods"]
  # The LM at llama_1b's shape: embeddings 2 x 32000 x 2048, 22 blocks of
  # 4 d (LayerNorms) + 3 d^2 + 3 d (qkv) + d^2 + d (proj) + 2 d f + f + d (MLP), f = 8448,
  # the final LayerNorm 2 d, positions 2048 x 2048 and the head bias 32000.
  d, f = 2048, 8448
  params = 2 * 32000 * d + 2048 * d + 22 * (4 * d + 3 * d * d + 3 * d + d * d + d
                                            + 2 * d * f + f + d) + 2 * d + 32000
  assert dp["parameters"] == params == 1_266_258_688
  assert summary["devices"] == 64
  assert dp["bytes_per_step"] == 2 * 63 / 64 * 4 * params  # the ring all-reduce at W = 64
  state = dp["state_bytes"]["params"] + dp["state_bytes"]["opt_state"]
  assert state > 3 * 4 * params  # parameters and AdamW's two moments, on every device
  assert peak_rss < state / 8, (peak_rss, state)
  # The step's peak (XLA:CPU's) is over the h100's 80 GB: flagged, with its excess.
  assert not dp["fits_hbm"] and dp["hbm_over_bytes"] == dp["memory"]["peak"] - 80e9 > 0
  assert f"| no: +{plan_cli._bytes(dp['hbm_over_bytes'])} |" in proc.stdout
  assert os.path.exists(summary["figure"])
  assert "| dp | data=64 |" in proc.stdout
