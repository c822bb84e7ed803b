"""Layouts: mesh and rules, tensor/sequence-parallel layers, FSDP layers, the LM on meshes.

Every parallel function is held against its single-device form in value and `jax.grad`
under jit; the LM under every mesh against the unsharded LM; bytes against formulas.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import comm, data, models, parallel, sync, train

LM = dict(d_model=16, num_layers=2, num_heads=4, d_ff=32, max_len=8)
BATCH, SEQ = 16, 8


def run_and_inspect(fn, *args, mesh):
  """Compiles once: the outputs of `fn(*args)` and the report of its collectives."""
  compiled = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args).compile()
  return compiled(*args), comm.parse_hlo(compiled.as_text(), mesh=mesh)


# ----------------------------------------------------------------------------- mesh, rules
def test_mesh_rules_and_bad_input():
  mesh = parallel.make_mesh("data=2,fsdp=2,tensor=2")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  layout = parallel.Layout(mesh)
  assert layout.batch_axes == ("data", "fsdp") and layout.gather_axes == ("fsdp",)
  assert layout.spec(("embed", "qkv", "heads", "head_dim")) == P("fsdp", None, "tensor", None)
  assert layout.local_shape((16, 3, 4, 4), ("embed", "qkv", "heads", "head_dim")) == (8, 3, 2, 4)
  # A dimension the axis does not divide stays whole.
  assert layout.spec(("mlp",), (3,)) == P(None)
  with pytest.raises(ValueError, match="multiply"):
    parallel.make_mesh({"data": 3, "tensor": 2})
  # One mesh builder: train re-exports it; axes the layouts do not read (e.g. the slow
  # `replica` axis of a method's sync) are plain axes.
  assert train.make_mesh is parallel.make_mesh
  assert dict(parallel.make_mesh({"replica": 2, "data": 4}).shape) == {"replica": 2, "data": 4}
  assert parallel.make_mesh((2, 4), ("data", "tensor")).axis_names == ("data", "tensor")
  with pytest.raises(ValueError, match="axis_names"):
    parallel.make_mesh((2, 4), ("data",))
  with pytest.raises(ValueError, match="axis=size"):
    parallel.parse_mesh("data:8")
  with pytest.raises(ValueError, match="unknown mesh axis"):
    parallel.make_rules(embed="model")
  with pytest.raises(ValueError, match="unknown mesh axis"):
    parallel.Layout(mesh, rules={"embed": "expert"})
  with pytest.raises(ValueError, match="rules must map the logical axis 'batch'"):
    parallel.Layout(mesh, rules={"embed": "tensor"})  # a table replaces the defaults
  with pytest.raises(ValueError, match="no rule"):
    layout.spec(("experts", "embed"))
  with pytest.raises(ValueError, match="divisible by the tensor axis"):
    models.TransformerLM(d_model=24, num_heads=3, layout=layout)
  with pytest.raises(ValueError, match="sequence_parallel"):
    parallel.Layout(parallel.make_mesh({"data": 8}), sequence_parallel=True)
  with pytest.raises(ValueError, match="collective_matmul"):
    parallel.Layout(mesh, collective_matmul=True)


def test_param_specs_and_replication_warning():
  lm = models.TransformerLM(**LM)
  params = jax.eval_shape(lm.init, jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
  layout = parallel.Layout(parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    specs = layout.param_specs(lm.param_axes(), params)
  block = specs["params"]["block0"]
  assert block["qkv"]["kernel"] == P("fsdp", None, "tensor", None)
  assert block["fc_out"]["kernel"] == P("tensor", "fsdp")
  assert block["ln_attn"]["scale"] == P(None)
  assert specs["params"]["embed"]["embedding"] == P(None, "fsdp")
  # Tensor parallelism alone leaves the embeddings and the head whole: most of this model.
  tp = parallel.Layout(parallel.make_mesh({"data": 4, "tensor": 2}))
  with pytest.warns(parallel.ReplicationWarning, match="replicated"):
    specs = tp.param_specs(lm.param_axes(), params)
  frac = parallel.replicated_fraction(params, specs, ["tensor"])
  assert 0.5 < frac < 1.0
  # Pure data parallelism is replicated by design: no warning.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    parallel.Layout(parallel.make_mesh({"data": 8})).param_specs(lm.param_axes(), params)


# ------------------------------------------------------------- tensor and sequence parallel
@pytest.fixture(scope="module")
def mesh_dt():
  return parallel.make_mesh({"data": 2, "tensor": 4})


def _tp_case(kind, key):
  d, h, dh, f = 16, 4, 4, 32
  k = jax.random.split(key, 6)
  x = jax.random.normal(k[0], (4, 8, d))
  if kind == "mlp":
    p = {"fc_in": {"kernel": jax.random.normal(k[1], (d, f)) / 4,
                   "bias": jax.random.normal(k[2], (f,))},
         "fc_out": {"kernel": jax.random.normal(k[3], (f, d)) / 6,
                    "bias": jax.random.normal(k[4], (d,))}}
    specs = {"fc_in": {"kernel": P(None, "tensor"), "bias": P("tensor")},
             "fc_out": {"kernel": P("tensor", None), "bias": P()}}
    fn = lambda p, x, axis, **kw: parallel.mlp_tp(x, p["fc_in"], p["fc_out"], axis, **kw)
  else:
    p = {"qkv": {"kernel": jax.random.normal(k[1], (d, 3, h, dh)) / 4,
                 "bias": jax.random.normal(k[2], (3, h, dh))},
         "proj": {"kernel": jax.random.normal(k[3], (h, dh, d)) / 4,
                  "bias": jax.random.normal(k[4], (d,))}}
    specs = {"qkv": {"kernel": P(None, None, "tensor", None), "bias": P(None, "tensor", None)},
             "proj": {"kernel": P("tensor", None, None), "bias": P()}}
    fn = lambda p, x, axis, **kw: parallel.attention_tp(x, p["qkv"], p["proj"], axis,
                                                         models.causal_attention, **kw)
  return p, specs, x, fn, jax.random.normal(k[5], x.shape)


_TP_REFERENCE = {}  # kind -> the single-device value and gradients (one compile per kind)


@pytest.mark.parametrize("kind,sp,cm", [("mlp", False, False), ("mlp", True, False),
                                        ("mlp", True, True), ("attention", False, False),
                                        ("attention", True, True)])
def test_tensor_parallel_layers_equal_single_device(mesh_dt, kind, sp, cm):
  p, specs, x, fn, probe = _tp_case(kind, jax.random.key(1))
  x_spec = P("data", "tensor") if sp else P("data")
  sharded = jax.shard_map(lambda p, x: fn(p, x, "tensor", sequence_parallel=sp,
                                          collective_matmul=cm),
                          mesh=mesh_dt, in_specs=(specs, x_spec), out_specs=x_spec)
  loss = lambda f: jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(f(p, x) * probe),
                                              argnums=(0, 1)))
  if kind not in _TP_REFERENCE:
    _TP_REFERENCE[kind] = loss(lambda p, x: fn(p, x, None))(p, x)
  ref_value, ref_grads = _TP_REFERENCE[kind]
  (value, grads), report = run_and_inspect(loss(sharded), p, x, mesh=mesh_dt)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  chex.assert_trees_all_close(grads, ref_grads, atol=1e-4, rtol=1e-4)
  # One reduction per block forward and one backward, over the tensor axis only.
  # Activations f32[B/data, T, D] on one device: 2 * 8 * 16 * 4 = 1024 bytes.
  # (SP's all-gather + reduce-scatter pairs move the same bytes as the all-reduce.)
  assert report.wire_bytes(axes=("tensor",)) == 2 * 1536  # 2 * 3/4 * 1024 bytes, twice
  if cm:
    assert len(report.select(op="collective-permute")) == 2 * 3  # W-1 hops, forward and backward


def test_collective_matmul_equals_allgather_matmul(mesh_dt):
  x = jax.random.normal(jax.random.key(2), (4, 8, 16))
  kernel = jax.random.normal(jax.random.key(3), (16, 12))
  f = jax.shard_map(lambda x, k: parallel.matmul_allgather_overlapped(x, k, "tensor"),
                    mesh=mesh_dt, in_specs=(P("data", "tensor"), P(None, "tensor")),
                    out_specs=P("data", None, "tensor"))
  g = jax.jit(jax.value_and_grad(lambda x, k: jnp.sum(jnp.sin(f(x, k))), argnums=(0, 1)))
  ref = jax.jit(jax.value_and_grad(lambda x, k: jnp.sum(jnp.sin(x @ k)), argnums=(0, 1)))
  chex.assert_trees_all_close(g(x, kernel), ref(x, kernel), atol=1e-4, rtol=1e-5)
  report = comm.inspect(jax.jit(f), x, kernel, mesh=mesh_dt)
  assert {c.op for c in report} == {"collective-permute"} and len(report) == 3
  # 3 ring hops of this device's f32[2, 2, 16] block = 256 bytes: the all-gather's 3 * 256.
  assert report.wire_bytes() == 768


# --------------------------------------------------------------------------------- FSDP
def test_fsdp_layer_gathers_twice_scatters_once():
  mesh = parallel.make_mesh({"data": 2, "fsdp": 4})
  k = jax.random.split(jax.random.key(4), 5)
  p = {"w1": jax.random.normal(k[0], (8, 16)) / 3, "b1": jax.random.normal(k[1], (16,)),
       "w2": jax.random.normal(k[2], (16, 8)) / 4, "b2": jax.random.normal(k[3], (8,))}
  specs = {"w1": P("fsdp", None), "b1": P("fsdp"), "w2": P(None, "fsdp"), "b2": P("fsdp")}
  regather = {"w1": True, "b1": True, "w2": True, "b2": False}  # b2 is added last
  layer = lambda p, x: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
  x = jax.random.normal(k[4], (16, 8))
  sharded = jax.shard_map(
      lambda p, x: parallel.fsdp(layer, specs, "fsdp", regather)(comm.varying(p, "data"), x),
      mesh=mesh, in_specs=(specs, P(("data", "fsdp"))), out_specs=P(("data", "fsdp")))
  loss = lambda f: jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(f(p, x))),
                                              argnums=(0, 1)))
  out, report = run_and_inspect(loss(sharded), p, x, mesh=mesh)
  chex.assert_trees_all_close(out, loss(layer)(p, x), atol=1e-4, rtol=1e-5)
  fsdp_ops = sorted((c.op, c.dtype, c.shape) for c in report if c.axes == ("fsdp",))
  # Forward gather of every shard (f32), backward re-gather (as bits) of those read again,
  # one reduce-scatter of every gradient: never a gathered parameter saved for backward.
  assert fsdp_ops == sorted(
      [("all-gather", "f32", s) for s in [(2, 16), (4,), (16, 2), (2,)]] +
      [("all-gather", "u32", s) for s in [(2, 16), (4,), (16, 2)]] +
      [("reduce-scatter", "f32", s) for s in [(8, 16), (16,), (16, 8), (8,)]])


# ---------------------------------------------------------------- the LM under every mesh
@pytest.fixture(scope="module")
def lm_reference():
  lm = models.TransformerLM(**LM)
  params = jax.jit(lm.init)(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
  batch = data.pydoc_text().batch(0, BATCH, seq_len=SEQ)
  loss, grads = jax.jit(jax.value_and_grad(models.lm_loss(lm)))(params, batch)
  return params, batch, loss, jax.tree.map(np.asarray, grads)


def _tensor_bytes(mesh_shape, sp, fsdp):
  """TP traffic of one LM step over `tensor` (docs/algorithms.md, Megatron), written out."""
  t, d, layers = mesh_shape["tensor"], LM["d_model"], LM["num_layers"]
  act = BATCH // mesh_shape.get("data", 1) // mesh_shape.get("fsdp", 1) * SEQ * d * 4
  allreduce = lambda nbytes: 2 * (t - 1) / t * nbytes
  if not sp:  # Attention and MLP: one all-reduce each forward, one each backward. FSDP
    # recomputes a block in its backward pass: the attention's all-reduce runs again (the
    # MLP's output is read by no gradient of the block, so it is not recomputed).
    return layers * (4 + fsdp) * allreduce(act)
  gather, scatter = (t - 1) * act / t, (t - 1) / t * act  # of the 1/t sequence slices
  per_block = 4 * (gather + scatter)  # the all-reduce split in two, forward and backward
  return (layers * per_block + gather  # the blocks; the invariant gather before the head
          + allreduce(act)  # backward of taking this device's slice
          + allreduce(layers * 6 * d * 4))  # norms, output biases on slices


MESHES = {
    "data8": ({"data": 8}, {}),
    "data4_tensor2": ({"data": 4, "tensor": 2}, {}),
    "data2_fsdp2_tensor2": ({"data": 2, "fsdp": 2, "tensor": 2}, {}),
    "data2_tensor4_sp": ({"data": 2, "tensor": 4}, {"sequence_parallel": True}),
}  # fsdp alone (ZeRO-3): tests/test_zero.py; collective matmul: the layer tests above.


@pytest.mark.parametrize("name", list(MESHES))
@pytest.mark.slow
def test_lm_under_every_mesh_equals_unsharded(lm_reference, name):
  params, batch, ref_loss, ref_grads = lm_reference
  shape, options = MESHES[name]
  mesh = parallel.make_mesh(shape)
  layout = parallel.Layout(mesh, **options)
  lm = models.TransformerLM(**LM, layout=layout)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", parallel.ReplicationWarning)
    specs = layout.param_specs(lm.param_axes(), params)
  # One SGD step with learning rate 1: the parameter change is the mean gradient.
  inner = optax.sgd(1.0)
  if layout.gather_axes:
    inner = parallel.zero(inner, 3, layout.gather_axes, param_specs=specs,
                          regather=lm.param_regather())
  rest = tuple(a for a in layout.batch_axes if a not in layout.gather_axes)
  trainer = train.Trainer(models.lm_loss(lm), optax.chain(sync.mean(rest or None), inner), mesh,
                          batch_axes=layout.batch_axes, param_specs=specs)
  state = trainer.init(params)
  (new, per_device, sent), report = run_and_inspect(trainer.step_fn(state, batch), state,
                                                    batch, mesh=mesh)
  m = trainer.measure(per_device, sent)  # measurements, jitted (eager: an op per compile)
  np.testing.assert_allclose(m["loss"], ref_loss, rtol=2e-6)
  grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, new.params)
  chex.assert_trees_all_close(grads, ref_grads, atol=2e-6, rtol=1e-4)
  if name == "data4_tensor2":  # Per worker (a slice of the batch): its loss and the norm
    # of its local gradient, whose tensor-parallel shards are summed over `tensor`.
    w = trainer.num_workers
    chunks = jax.tree.map(lambda x: x.reshape(w, -1, *x.shape[1:]), batch)
    losses, local = jax.jit(jax.vmap(jax.value_and_grad(models.lm_loss(
        models.TransformerLM(**LM))), in_axes=(None, 0)))(params, chunks)
    np.testing.assert_allclose(m["per_worker"]["loss"], losses, rtol=1e-5)
    norms = np.sqrt(sum(np.sum(np.asarray(g).reshape(w, -1) ** 2, axis=1)
                        for g in jax.tree.leaves(local)))
    np.testing.assert_allclose(m["per_worker"]["grad_norm"], norms, rtol=1e-4)
  # Bytes: the optimiser's (counted in its state) are everything off the tensor axis;
  # the tensor axis carries the Megatron reductions per block.
  tensor = report.wire_bytes(axes=("tensor",))
  assert report.wire_bytes() - tensor == int(sent)
  assert tensor == (_tensor_bytes(shape, options.get("sequence_parallel", False),
                                  bool(layout.gather_axes)) if "tensor" in shape else 0)
