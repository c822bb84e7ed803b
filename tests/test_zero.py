"""ZeRO 1/2/3: equal to data parallelism, bytes three ways, 1/W memory, compression.

Stages 1-3 are held against exact DP with the same optimiser; counted bytes against
`comm.inspect` of the compiled step (which shares the counters' per-op byte helpers: it
proves shapes and trip counts) and against formulas written here from docs/algorithms.md;
per-device optimiser-state bytes against the compiled memory analysis; compressed stage 1
against uncompressed training.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, data, models, parallel, sync, testing, train
from test_validation import JUNK, builds_or_value_error, junk, ok, valid_or

W = 8
LM = dict(d_model=16, num_layers=2, num_heads=4, d_ff=32, max_len=8)
BATCH, SEQ = 16, 8


def adam():
  # eps well above float32 noise: a few gradients (the key bias) are exactly zero in
  # theory, and adam would turn their rounding noise into full-size steps.
  return optax.adam(1e-2, eps=1e-4)


def compile_step(trainer, state, batch):
  """The step compiled once, and the report of its collectives."""
  compiled = trainer.step_fn(state, batch).lower(state, batch).compile()
  return compiled, comm.parse_hlo(compiled.as_text(), mesh=trainer.mesh)


def per_device_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------- the compressed scatter
# Float payloads travel as their bit patterns (u32, u16); a payload of several leaves (int8
# codes and f32 scales) travels packed into one u8 buffer.
# Bytes: every device sends 7 of its 8 encoded chunks of 16 elements: identity 7 * 64;
# bf16 7 * 32; int8 codes + one f32 scale 7 * (16 + 4); top-4 (f32 value, u8 index) 7 * 20.
@pytest.mark.parametrize("codec,wire,nbytes", [(codecs.identity(), {"u32"}, 448),
                                               (codecs.cast("bfloat16"), {"u16"}, 224),
                                               (codecs.uniform(8), {"u8"}, 140),
                                               (codecs.top_k(0.25), None, 140)],
                         ids=["identity", "bf16", "int8", "top_k"])
def test_reduce_scatter_encoded(mesh8, codec, wire, nbytes):
  x = jax.random.normal(jax.random.key(0), (W, W * 16))
  record = {}

  def body(xb):
    out, nbytes = comm.reduce_scatter_encoded(xb[0], codec, "data")
    record["bytes"] = nbytes
    return out.chunk, out.own[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("data"),
                            out_specs=(P("data"), P("data"))))
  compiled = f.lower(x).compile()
  shard, sent = compiled(x)
  # Device r holds the float32 sum of what every device's chunk r decodes to.
  np.testing.assert_allclose(shard, sent.sum(0), rtol=1e-5, atol=1e-5)
  # ... which is the exact sum up to the codec's error bound on each of the W summands.
  bound = float(codec.error_bound(x.ravel())) * W
  np.testing.assert_allclose(shard, x.sum(0), atol=bound + 1e-5)
  report = comm.parse_hlo(compiled.as_text(), mesh=mesh8)
  assert record["bytes"] == nbytes == report.wire_bytes()
  assert [c.op for c in report] == ["all-to-all"]
  if wire is not None:
    assert {d for c in report for d in c.dtype.split(",")} == wire


# ------------------------------------------------------------ ZeRO against DP on the LM
def _lm_task():
  lm = models.TransformerLM(**LM)
  params = lm.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
  ds = data.pydoc_text()
  return lm, params, lambda t: ds.batch(t, BATCH, seq_len=SEQ)


def _zero3_setup(mesh):
  """ZeRO-3 over the data axis: the rules shard every dimension they can over `data`."""
  rules = parallel.make_rules(embed="data", mlp="data", norm="data", vocab="data")
  layout = parallel.Layout(mesh, rules=rules)
  lm = models.TransformerLM(**LM, layout=layout)
  return lm, layout


@pytest.fixture(scope="module")
def lm_runs(mesh8):
  """DP and ZeRO 1/2/3 with the same adam, two steps each; compiled once per method."""
  lm, params, batch_fn = _lm_task()
  lm3, layout3 = _zero3_setup(mesh8)
  specs3 = layout3.param_specs(lm3.param_axes(), params)
  methods = {
      "dp": (lm, optax.chain(sync.mean("data"), adam()), None),
      "zero1": (lm, parallel.zero(adam(), 1, "data"), None),
      # Stage 2 differs from stage 1 only with micro-batches: test_accumulation_... below.
      "zero3": (lm3, parallel.zero(adam(), 3, "data", param_specs=specs3,
                                   regather=lm3.param_regather()), specs3),
  }
  runs = {}
  for name, (model, tx, specs) in methods.items():
    # Not donated: later tests start again from state0.
    trainer = train.Trainer(models.lm_loss(model), tx, mesh8, param_specs=specs,
                            donate=False)
    state = state0 = trainer.init(params)
    compiled, report = compile_step(trainer, state, batch_fn(0))
    sent = []
    for t in range(2):
      state, _, nbytes = compiled(state, batch_fn(t))
      sent.append(int(nbytes))
    runs[name] = dict(trainer=trainer, state0=state0, state=state, compiled=compiled,
                      report=report, sent=sent, specs=specs, model=model)
  return params, batch_fn, runs


@pytest.mark.slow
def test_zero_stages_equal_data_parallel(lm_runs):
  _, _, runs = lm_runs
  for name in ("zero1", "zero3"):
    chex.assert_trees_all_close(runs[name]["state"].params, runs["dp"]["state"].params,
                                atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_zero_bytes_counted_inspected_and_formula(lm_runs):
  params, _, runs = lm_runs
  n = sum(x.size for x in jax.tree.leaves(params))
  assert n % W == 0  # so that ZeRO's padded vector is exactly DP's
  # DP: all-reduce of 4n bytes, 2(W-1)/W 4n. ZeRO-1: reduce-scatter of the f32 vector,
  # (W-1)/W 4n, plus all-gather of the updated 4n/W chunk, (W-1) 4n/W: the same total.
  dp = 2 * (W - 1) / W * 4 * n
  assert (W - 1) / W * 4 * n + (W - 1) * 4 * n / W == dp
  for name in ("dp", "zero1"):
    run = runs[name]
    assert run["sent"] == [dp, dp] and run["report"].wire_bytes() == dp, name
  ops = sorted(c.op for c in runs["zero1"]["report"])
  assert ops == ["all-gather", "reduce-scatter"]  # one of each for the whole model
  # Stage 3: per parameter, a forward all-gather, a backward re-gather of those whose value
  # the backward reads, and a reduce-scatter: 1.5x DP's all-reduce of that parameter (1x
  # without the re-gather); replicated parameters are all-reduced as in DP.
  run = runs["zero3"]
  specs = jax.tree.leaves(run["specs"], is_leaf=lambda s: isinstance(s, P))
  regather = jax.tree.leaves(run["model"].param_regather())
  formula, ratios = 0.0, set()
  for x, spec, again in zip(jax.tree.leaves(params), specs, regather):
    leaf_dp = 2 * (W - 1) / W * 4 * x.size
    ratio = (1.5 if again else 1.0) if "data" in parallel.spec_axes(spec) else 1.0
    formula += ratio * leaf_dp
    ratios.add(ratio)
  assert ratios == {1.0, 1.5}
  assert run["sent"] == [formula, formula] and run["report"].wire_bytes() == formula


@pytest.mark.slow
def test_zero_optimizer_state_memory_falls_as_one_over_w(lm_runs):
  params, batch_fn, runs = lm_runs
  n = sum(x.size for x in jax.tree.leaves(params))
  batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch_fn(0))) // W

  def state_bytes(run):
    """Per-device bytes of the optimiser state, from the compiled memory analysis."""
    args = run["compiled"].memory_analysis().argument_size_in_bytes
    return args - per_device_bytes(run["state0"].params) - batch_bytes - 4  # 4: step

  for run in runs.values():  # The analysis agrees with the state's own shards.
    assert state_bytes(run) == per_device_bytes(run["state0"].opt_state)
  # Adam keeps two f32 vectors; counters (adam's count, byte counters) are a few bytes.
  assert state_bytes(runs["dp"]) == 2 * 4 * n + 8
  assert state_bytes(runs["zero1"]) == 2 * 4 * n // W + 12
  assert state_bytes(runs["zero3"]) < state_bytes(runs["dp"]) / W * 1.1
  assert per_device_bytes(runs["zero3"]["state0"].params) < per_device_bytes(params) / W * 1.1


def test_zero_memory_scales_with_w_on_submeshes():
  model = models.MLP(hidden=(32,), num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  batch = data.digits().batch(0, 64)
  n = sum(x.size for x in jax.tree.leaves(params))
  for w in (2, 4, 8):
    mesh = train.make_mesh({"data": w}, devices=jax.devices()[:w])
    trainer = train.Trainer(loss, parallel.zero(adam(), 1, "data"), mesh)
    state = trainer.init(params)
    analysis = trainer.step_fn(state, batch).lower(state, batch).compile().memory_analysis()
    opt = (analysis.argument_size_in_bytes - per_device_bytes(params)
           - per_device_bytes(trainer.shard_batch(batch)) - 4)
    assert opt == 2 * 4 * ((n + (-n % w)) // w) + 12, w  # DP: 2 * 4 * n + 8


# -------------------------------------------------------------- compression with sharding
@pytest.mark.slow
def test_compressed_zero1_trains_lm_like_uncompressed(mesh8, lm_runs):
  params, batch_fn, runs = lm_runs
  lm = runs["zero1"]["model"]
  steps = 40
  variants = {"f32": runs["zero1"],
              "bf16": parallel.zero(adam(), 1, "data", codecs.cast("bfloat16")),
              "int8": parallel.zero(adam(), 1, "data", codecs.uniform(8), memory="ef")}
  losses, first, scatter_bytes, counted = {}, {}, {}, {}
  for name, tx in variants.items():
    if isinstance(tx, dict):
      compiled, report, state = tx["compiled"], tx["report"], tx["state0"]
    else:
      trainer = train.Trainer(models.lm_loss(lm), tx, mesh8)
      state = trainer.init(params)
      compiled, report = compile_step(trainer, state, batch_fn(0))
    history = []
    for t in range(steps):
      state, per_device, nbytes = compiled(state, batch_fn(t))
      history.append(float(jnp.mean(per_device["loss"])))
    losses[name], first[name] = np.mean(history[-5:]), np.mean(history[:2])
    counted[name] = int(nbytes)
    scatter_bytes[name] = report.wire_bytes(op="all-to-all" if name != "f32" else
                                            "reduce-scatter")
    assert counted[name] == report.wire_bytes()
  # It learns more than byte frequencies: below the entropy of the targets' unigram
  # distribution (the best loss of a model that ignores the context), measured on the same
  # 40 batches (plug-in estimate, biased low: a strict bound).
  targets = np.concatenate([np.ravel(batch_fn(t)["tokens"][:, 1:]) for t in range(steps)])
  freq = np.bincount(targets, minlength=256) / targets.size
  unigram = -np.sum(freq[freq > 0] * np.log(freq[freq > 0]))
  assert losses["f32"] < unigram, (losses, unigram)
  for name in ("bf16", "int8"):
    assert abs(losses[name] - losses["f32"]) < 0.03 * losses["f32"], losses
  n = sum(x.size for x in jax.tree.leaves(params))
  m = n // W
  assert scatter_bytes["bf16"] == scatter_bytes["f32"] / 2
  assert (scatter_bytes["int8"] == scatter_bytes["f32"] * (m + 4) / (4 * m)
          < 0.26 * scatter_bytes["f32"])


# ----------------------------------------------- micro-batches: where stages 1 and 2 differ
def test_accumulation_stage1_vs_stage2(mesh8):
  model = models.MLP(hidden=(32,), num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  ds = data.digits()
  n = sum(x.size for x in jax.tree.leaves(params))
  n_pad = n + (-n % W)
  dp = train.Trainer(loss, optax.chain(sync.mean("data"),
                                       optax.MultiSteps(adam(), 2).gradient_transformation()),
                     mesh8)
  ref = dp.init(params)
  for t in range(4):
    ref, _ = dp.step(ref, ds.batch(t, 64))
  rs, ag = (W - 1) / W * 4 * n_pad, (W - 1) * 4 * n_pad // W  # reduce-scatter, all-gather
  for stage, per_step, acc in ((1, [0, rs + ag] * 2, n_pad), (2, [rs, rs + ag] * 2, n_pad // W)):
    trainer = train.Trainer(loss, parallel.zero(adam(), stage, "data", accumulate_steps=2),
                            mesh8)
    state = trainer.init(params)
    # Stage 1 accumulates the whole local gradient, stage 2 only its reduced 1/W chunk.
    assert per_device_bytes(state.opt_state.accumulated) == 4 * acc
    sent = []
    for t in range(4):
      state, m = trainer.step(state, ds.batch(t, 64))
      sent.append(int(m["wire_bytes"]))
    assert sent == per_step, (stage, sent)
    chex.assert_trees_all_close(state.params, ref.params, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("memory,keep,rtol", [
    ("ef", lambda e, p, sent: p - sent, 0.0),
    (sync.loco(0.5, jnp.float32), lambda e, p, sent: 0.5 * e + 0.5 * (p - sent), 1e-6)],
    ids=["ef", "loco"])
def test_zero_error_memory_is_the_shared_record_exactly(memory, keep, rtol):
  """On one device: the update is -D(C(g + e)) and the memory keeps e <- keep(e, g + e,
  D(C(g + e))), step after step (numpy references of error feedback, and of LoCo with
  beta 0.5 in float32: e <- 0.5 e + 0.5 (p - D(C(p))))."""
  codec = codecs.uniform(4)
  tx = parallel.zero(optax.sgd(1.0), 1, None, codec, memory=memory)
  params = {"w": jnp.zeros(5), "b": jnp.zeros(2)}
  state, e = tx.init(params), np.zeros(7, np.float32)
  update, roundtrip = jax.jit(tx.update), jax.jit(codec.roundtrip)
  rng = np.random.default_rng(0)
  for _ in range(3):
    g = rng.normal(size=7).astype(np.float32)
    updates, state = update({"b": jnp.asarray(g[:2]), "w": jnp.asarray(g[2:])}, state, params)
    p = g + e
    sent = np.asarray(roundtrip(jnp.asarray(p)))
    e = keep(e, p, sent)
    np.testing.assert_allclose(np.concatenate([updates["b"], updates["w"]]), -sent, rtol=rtol,
                               atol=0)
    np.testing.assert_allclose(state.error, e, rtol=rtol, atol=rtol / 10)
  assert np.abs(e).max() > 1e-3


# ------------------------------------ the contract on the mesh (one device: tests/contract.py)
@pytest.mark.parametrize("kwargs", [dict(stage=1, codec=codecs.uniform(8), memory="ef"),
                                    dict(stage=1, accumulate_steps=2),
                                    dict(stage=2, accumulate_steps=2)],
                         ids=["stage1_int8_ef", "stage1_accumulate", "stage2_accumulate"])
def test_zero_contract_on_mesh(mesh8, kwargs):
  # Compiles once, keeps the state's types, counts exactly what comm.inspect reads.
  testing.check_on_mesh(parallel.zero(optax.sgd(0.1), axis_name="data", **kwargs), mesh8)


def test_zero_bad_input():
  inner = optax.sgd(0.1)
  with pytest.raises(ValueError, match="stage"):
    parallel.zero(inner, stage=4)
  with pytest.raises(ValueError, match="memory"):
    parallel.zero(inner, 1, codec=codecs.cast("bfloat16"), memory="ef21x")
  with pytest.raises(ValueError, match="memory needs a codec"):
    parallel.zero(inner, 1, memory="ef")
  with pytest.raises(ValueError, match="param_specs"):
    parallel.zero(inner, 3)
  with pytest.raises(ValueError, match="stages 1 and 2"):
    parallel.zero(inner, 3, param_specs={}, codec=codecs.cast("bfloat16"))
  with pytest.raises(ValueError, match="accumulate_steps"):
    parallel.zero(inner, 1, accumulate_steps=0)
  with pytest.raises(ValueError, match="codec"):
    parallel.zero(inner, 1, codec="bf16")


# ------------------------------------------------ property: builds and works, or ValueError
def _zero_joint(values):
  """Valid alone, not together: a memory needs a codec; stage 3 takes neither a codec nor
  micro-batches (its reduce-scatter is the model's backward pass)."""
  bad = []
  if values["memory"] == "ef" and values["codec"] is None:
    bad += ["memory", "codec"]
  if values["stage"] == 3 and (values["codec"] is not None or values["accumulate_steps"] != 1):
    bad += ["codec", "accumulate_steps"]
  return bad


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(stage=valid_or(st.sampled_from([1, 2, 3])),
       axis_name=valid_or(st.sampled_from([None, "data"])),
       codec=valid_or(st.sampled_from([None, codecs.cast("bfloat16")])),
       memory=valid_or(st.sampled_from([None, "ef"])),
       accumulate_steps=valid_or(st.integers(1, 2)))
@example(stage=ok(1), axis_name=ok("data"), codec=ok(codecs.cast("bfloat16")), memory=ok("ef"),
         accumulate_steps=ok(2))
@example(stage=ok(3), axis_name=ok("data"), codec=ok(None), memory=ok(None),
         accumulate_steps=ok(1))
def test_zero_builds_and_runs_or_raises_value_error(mesh8, stage, axis_name, codec, memory,
                                                    accumulate_steps):
  params = {"w": jnp.arange(8.0), "b": jnp.ones(())}
  specs = {"w": P("data"), "b": P()}

  def check(tx):
    def update(p):  # each worker's own gradient (varying), as the Trainer passes it
      grads = jax.tree.map(lambda x: x + 1,
                           comm.varying(p, "data" if axis_name.value else None))
      return tx.update(grads, tx.init(p), p)[0]

    if axis_name.value is None:
      out = update(params)
    else:
      in_specs = (specs,) if stage.value == 3 else (P(),)
      stack = lambda out: jax.tree.map(lambda x: comm.varying(x, "data")[None], out)
      out = jax.jit(jax.shard_map(lambda p: stack(update(p)), mesh=mesh8, in_specs=in_specs,
                                  out_specs=P("data")))(params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))

  builds_or_value_error(
      lambda **kw: parallel.zero(optax.sgd(0.1), param_specs=specs, **kw), check,
      joint=_zero_joint, stage=stage, axis_name=axis_name, codec=codec, memory=memory,
      accumulate_steps=accumulate_steps)


def _layout(shape, rules, sequence_parallel):
  return parallel.Layout(parallel.make_mesh(shape), rules=rules,
                         sequence_parallel=sequence_parallel)


def _layout_joint(values):  # sequence parallelism splits over a tensor axis of size > 1
  shape = values["shape"]
  if values["sequence_parallel"] is True and isinstance(shape, (dict, str)) and \
     "tensor" not in str(shape):
    return ["sequence_parallel"]
  return []


@settings(max_examples=25, deadline=None, derandomize=True)
@given(shape=valid_or(st.sampled_from(["data=8", "data=2,fsdp=2,tensor=2", {"tensor": 8}]),
                      st.one_of(st.dictionaries(st.sampled_from(["data", "tensor", "x"]),
                                                st.integers(0, 8), max_size=2), JUNK)),
       # A table replaces the defaults: valid ones are complete (make_rules keeps the rest).
       rules=valid_or(st.sampled_from([None, parallel.make_rules(embed="tensor"),
                                       tuple(parallel.make_rules(mlp=("data",)))]),
                      st.one_of(st.sampled_from([{"embed": "tensor"}, (("mlp", ("data",)),)]),
                                st.dictionaries(st.text(max_size=3), JUNK, max_size=2), JUNK)),
       sp=valid_or(st.booleans()))
@example(shape=ok("data=2,fsdp=2,tensor=2"), rules=ok(parallel.make_rules(embed="tensor")),
         sp=ok(True))
@example(shape=ok("data=8"), rules=junk({"embed": "tensor"}), sp=ok(False))  # no 'batch' rule
def test_layout_builds_or_raises_value_error(shape, rules, sp):
  def check(layout):
    assert layout.spec(("batch",)) is not None
  builds_or_value_error(_layout, check, joint=_layout_joint, shape=shape, rules=rules,
                        sequence_parallel=sp)
