"""Every method over replicas of a sharded model: `replica x fsdp x tensor` on 8 devices.

The method synchronises over `replica`; ZeRO-3 (`fsdp`) and tensor parallelism run inside
each replica (`parallel.Layout.optimizer`). Held against references that run the same
method over 2 workers with unsharded copies of the parameters.
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from experiments import build
from experiments import config as _config
from jaxcomm import codecs, comm, data, local, models, parallel, sync, train

# Every local last dimension on this mesh is a multiple of 8 (the codec block below), so a
# codec's blocks hold the same elements sharded or not (see test_methods_equal_unsharded).
LM = dict(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=8)
MESH = "replica=2,fsdp=2,tensor=2"
R = 2  # replicas
# Not from JAXCOMM_TEST_CACHE: loaded from it, XLA:CPU ran the every-method program's devices
# out of step until its rendezvous timeout aborted the process (tests/conftest.py).
PERSISTENT_CACHE = False


@pytest.fixture(scope="module")
def setup():
  layout = parallel.Layout(parallel.make_mesh(MESH))
  lm = models.TransformerLM(**LM, layout=layout)
  params = models.TransformerLM(**LM).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  specs = layout.param_specs(lm.param_axes(), params)
  mesh2 = parallel.make_mesh({"replica": R}, devices=jax.devices()[:R])
  return layout, lm, params, specs, mesh2


def host(tree):
  return jax.tree.map(np.asarray, tree)


# ---------------------------------------------------------------- methods on given gradients
def linear_loss(scales):
  """loss(p, g) = sum_leaves scale * <p, mean of g's rows>: a worker's gradient is exactly
  the mean of the rows of g it holds (one row per worker; ACCO's micro-batches split two).

  `scales` undo what the layout does to a gradient: ZeRO-3 divides the gradient of a leaf
  sharded over `fsdp` by 2 (it expects the model's reduce-scatter sum), and a leaf
  replicated over `tensor` gets the sum over `tensor` of every device's gradient.
  """
  def loss(p, g):
    terms = jax.tree.map(lambda s, x, y: s * jnp.sum(x * jnp.mean(y, axis=0)), scales, p, g)
    return sum(jax.tree.leaves(terms))
  return loss


def layout_scales(layout, specs):
  def scale(spec):
    axes = parallel.spec_axes(spec)
    return ((layout.size("fsdp") if "fsdp" in axes else 1) /
            (1 if "tensor" in axes else layout.size("tensor")))
  return jax.tree.map(scale, specs, is_leaf=lambda s: isinstance(s, P))


def gradients(params, steps, rows=1):
  """Per step, `rows` gradients of every replica: leaves [R * rows, *shape] (float32
  normal / 10)."""
  keys = jax.random.split(jax.random.key(1), steps)
  def one(key):
    leaves, treedef = jax.tree.flatten(params)
    ks = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [0.1 * jax.random.normal(k, (R * rows, *x.shape))
                                        for k, x in zip(ks, leaves)])
  return [host(one(k)) for k in keys]


OUTER = lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)
METHODS = {
    "diloco": lambda specs: local.diloco(optax.sgd(0.1), OUTER(), 2, "replica"),
    "streaming_diloco": lambda specs: local.streaming_diloco(
        optax.sgd(0.1), OUTER(), 2, fragments=2, axis_name="replica",
        codec=codecs.fp4(block=4)),
    "powersgd": lambda specs: optax.chain(
        sync.powersgd(2, axis_name="replica", param_specs=specs), optax.sgd(0.1)),
    "compressed_int8_ef": lambda specs: optax.chain(
        sync.compressed(codecs.uniform(8, block=8), memory="ef", axis_name="replica"),
        optax.sgd(0.1)),
    "acco": lambda specs: local.acco(optax.sgd(0.1), "replica", micro_batches=ACCO_MICRO),
}
ACCO_MICRO = 2  # ACCO's micro-batches per replica and round: two rows of the gradients
# The loss each worker differentiates, where the method's module wraps it (build.task_loss).
WRAP_LOSS = {"acco": lambda loss: local.micro_batch_loss(loss, ACCO_MICRO, "replica")}
ROWS = {"acco": ACCO_MICRO}


_RUNS = {}


def run_both(setup, name, steps=6):
  """(sharded trainer, its state, reference trainer, its state) after `steps` steps."""
  if (name, steps) not in _RUNS:
    _RUNS[name, steps] = _run_both(setup, name, steps)
  return _RUNS[name, steps]


def _run_both(setup, name, steps):
  layout, _, params, specs, mesh2 = setup
  grads = gradients(params, steps, ROWS.get(name, 1))
  batch_specs = jax.tree.map(lambda s: P("replica", *s), specs,
                             is_leaf=lambda s: isinstance(s, P))
  wrap = WRAP_LOSS.get(name, lambda loss: loss)
  sharded = train.Trainer(wrap(linear_loss(layout_scales(layout, specs))),
                          layout.optimizer(METHODS[name](specs), specs), layout.mesh,
                          batch_axes=layout.batch_axes, param_specs=specs,
                          batch_specs=batch_specs)
  return Run(sharded, *run_against_unsharded(sharded, METHODS[name], params, specs, mesh2,
                                              grads, wrap))


def run_against_unsharded(sharded, method, params, specs, mesh2, grads, wrap=lambda f: f):
  """Steps `sharded` and unsharded workers on `mesh2` running `method(None)` (their loss
  `wrap`ped) through the same gradients: (sharded state, reference trainer, its state,
  compiled report, bytes per step)."""
  ones = jax.tree.map(lambda _: 1.0, params)
  ref = train.Trainer(wrap(linear_loss(ones)), parallel.by_sharding(method(None), specs),
                      mesh2, batch_axes="replica")
  s, r = sharded.init(params), ref.init(params)
  compiled, report = compile_step(sharded, s, grads[0])
  sent = []
  for g in grads:
    s, _, nbytes = compiled(s, g)
    sent.append(int(nbytes))
    r, _ = ref.step(r, g)
  return s, ref, r, report, sent


class Run(NamedTuple):
  trainer: train.Trainer   # the sharded run on replica x fsdp x tensor
  state: train.TrainState
  ref: train.Trainer       # 2 unsharded workers
  ref_state: train.TrainState
  report: comm.CollectiveReport  # the sharded step's collectives
  sent: list               # bytes counted per step


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.slow
def test_methods_equal_unsharded(setup, name):
  """Each replica's parameters after 3 syncs equal those of 2 unsharded workers.

  The workers get exactly the same gradients (a linear loss), so what is compared is the
  method under sharding. DiLoCo and ACCO (two micro-batches per round, its loss wrapped by
  `micro_batch_loss` as its method module does) are element-wise; PowerSGD runs on the
  whole matrices through small inner-axis collectives; the int8 codec quantises the flat
  vector of this device's shards in blocks of 8, and Streaming's fp4 its fragments (every
  2nd element) in blocks of 4: such blocks hold the same elements as the unsharded ones
  because every shard's last dimension is a multiple of 8 = 4 x 2.
  """
  sharded, s, ref, r = run_both(setup, name)[:4]
  fsdp = sharded.mesh.shape["fsdp"]
  for replica in range(R):
    got = sharded.worker_view(s.params, sharded.layout.params, replica * fsdp)
    want = ref.worker_view(r.params, ref.layout.params, replica)
    chex.assert_trees_all_close(host(got), host(want), rtol=1e-5, atol=1e-6)
  moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                                           host(want), host(setup[2]))))
  assert moved > 1e-2  # the comparison is not between two unmoved models


@pytest.mark.slow
def test_powersgd_inner_collectives_counted_on_their_axes(setup):
  """PowerSGD on shards: per matrix, P = M Q is summed over the axes splitting the columns,
  P's row blocks are all-gathered over the axes splitting the rows, Q = M^T P^ is summed
  over those; the replica axis carries P (with the exact leaves) and Q of the local blocks.
  Counted == compiled == this hand derivation, axis by axis (float32, R = 2)."""
  layout, _, params, specs, _ = setup
  run = run_both(setup, "powersgd")
  size = lambda axes: int(np.prod([layout.size(a) for a in axes]))
  allreduce = lambda nbytes, w: 2 * (w - 1) / w * nbytes
  want = {}
  add = lambda axes, nbytes: want.__setitem__(axes, want.get(axes, 0.0) + nbytes) \
      if axes and nbytes else None
  for x, spec in zip(jax.tree.leaves(params),
                     jax.tree.leaves(specs, is_leaf=lambda q: isinstance(q, P))):
    dims = [tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a)
            for e in tuple(spec) + (None,) * (x.ndim - len(spec))]
    local = x.size // size(sum(dims, ()))
    # The matrix view: the first k dimensions x the rest, k sending the least at rank 2.
    sent = lambda k: min(2, np.prod(x.shape[:k]), np.prod(x.shape[k:])) * (
        np.prod(x.shape[:k]) + np.prod(x.shape[k:]))
    k = min(range(1, max(x.ndim, 2)), key=sent)
    rows, cols = int(np.prod(x.shape[:k])), int(np.prod(x.shape[k:]))
    row_axes, col_axes = sum(dims[:k], ()), sum(dims[k:], ())
    n, m, n_axes, m_axes = ((cols, rows, col_axes, row_axes) if rows > cols
                            else (rows, cols, row_axes, col_axes))
    r = min(2, n)
    if x.ndim < 2 or not (n + m) * r * 2 < n * m:  # reduced exactly, with P
      add(("replica",), allreduce(4 * local, R))
      continue
    p_loc, q_loc = 4 * n // size(n_axes) * r, 4 * m // size(m_axes) * r
    add(m_axes, allreduce(p_loc, size(m_axes)))             # P = M Q over column shards
    add(("replica",), allreduce(p_loc, R) + allreduce(q_loc, R))  # the method's P and Q
    add(n_axes, (size(n_axes) - 1) * p_loc)                 # P's row blocks gathered
    add(n_axes, allreduce(q_loc, size(n_axes)))             # Q = M^T P^ over row shards
  # The layout inside the replica: ZeRO-3's mean over fsdp of leaves not sharded over it;
  # the loss's cotangent summed over tensor (4 bytes, uncounted: autodiff's).
  for x, spec in zip(jax.tree.leaves(params),
                     jax.tree.leaves(specs, is_leaf=lambda q: isinstance(q, P))):
    if "fsdp" not in parallel.spec_axes(spec):
      add(("fsdp",), allreduce(4 * x.size // size(parallel.spec_axes(spec)), 2))
  add(("tensor",), 4.0)
  assert run.report.by_axis() == pytest.approx(want)
  # Counted: everything compiled but autodiff's 4 bytes, plus the FSDP layer traffic that
  # ZeRO-3 counts for the model (gather, re-gather, reduce-scatter: 3 (F-1) b per shard of
  # b bytes, F = 2), which a linear loss does not run.
  layer = sum(3 * b for b, spec in zip(
      jax.tree.leaves(local_bytes(params, specs, layout.mesh)),
      jax.tree.leaves(specs, is_leaf=lambda q: isinstance(q, P)))
              if "fsdp" in parallel.spec_axes(spec))
  assert run.sent == pytest.approx([run.report.wire_bytes() - 4.0 + layer] * len(run.sent))


@pytest.mark.slow
def test_acco_bytes_per_axis(setup):
  """ACCO per group of equally sharded leaves, on one device's flat shards of n elements,
  padded to S = n rounded up to a multiple of R: the replica axis carries one i32 all-reduce
  of the micro-batch counts (2 (R-1)/R x 4 bytes), one reduce-scatter of the f32 buffer
  ((R-1)/R x 4S) and one all-gather of the new parameter chunk ((R-1) x 4S/R), every round.
  fsdp and tensor carry the layout's traffic (as for PowerSGD above). Counted == compiled
  (but autodiff's bytes) == this hand derivation."""
  layout, _, params, specs, _ = setup
  run = run_both(setup, "acco")
  allreduce = lambda nbytes, w: 2 * (w - 1) / w * nbytes
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda q: isinstance(q, P))
  shard = jax.tree.leaves(local_bytes(params, specs, layout.mesh))
  groups = {}
  for b, spec in zip(shard, spec_leaves):
    label = parallel.sharding_label(spec)
    groups[label] = groups.get(label, 0) + b // 4
  assert len(groups) == 4  # fsdp+tensor, fsdp, tensor, replicated
  replica = 0.0
  for n in groups.values():
    padded = n + (-n) % R
    replica += allreduce(4, R) + (R - 1) / R * 4 * padded + (R - 1) * 4 * padded / R
  fsdp = sum(allreduce(b, 2) for b, spec in zip(shard, spec_leaves)
             if "fsdp" not in parallel.spec_axes(spec))
  # tensor: the loss's cotangent summed once per micro-batch, inside the scan (uncounted).
  want = {("replica",): replica, ("fsdp",): fsdp, ("tensor",): 4.0 * ACCO_MICRO}
  assert run.report.by_axis() == pytest.approx(want)
  layer = sum(3 * b for b, spec in zip(shard, spec_leaves) if "fsdp" in parallel.spec_axes(spec))
  assert run.sent == pytest.approx([replica + fsdp + layer] * len(run.sent))


# ------------------------------------------------------------------- the LM, bytes per axis
BATCH, SEQ = 8, 8


def local_bytes(params, specs, mesh):
  """Bytes of each parameter's shard on one device: whole bytes / its shard count."""
  def one(x, spec):
    return 4 * x.size // np.prod([mesh.shape[a] for a in parallel.spec_axes(spec)], dtype=int)
  return jax.tree.map(one, params, specs, is_leaf=lambda s: isinstance(s, P))


def layout_bytes(setup, regather_tree):
  """Hand-derived wire bytes per step of the layout inside a replica: {axis: bytes}.

  fsdp (ZeRO-3): a leaf sharded over fsdp is gathered in the forward pass, gathered again
  in the backward pass when its layer's gradient reads it, and its gradient
  reduce-scattered: (F-1) b + (F-1) b + (F-1) b for a shard of b bytes. A leaf replicated
  over fsdp has its gradient all-reduced: 2 (F-1)/F b. tensor (Megatron): per block one
  all-reduce of the activations f32[B/(R F), T, D] after attention and one after the MLP,
  forward and backward, and the attention's again when FSDP recomputes the block in the
  backward pass: 5 all-reduces of 2 (T_size-1)/T_size * act bytes.
  """
  layout, _, params, specs, _ = setup
  f, t = layout.size("fsdp"), layout.size("tensor")
  sizes = jax.tree.leaves(local_bytes(params, specs, layout.mesh))
  fsdp = 0.0
  for b, spec, again in zip(sizes, jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)),
                            jax.tree.leaves(regather_tree)):
    if "fsdp" in parallel.spec_axes(spec):
      fsdp += (1 + again) * (f - 1) * b + (f - 1) / f * (f * b)
    else:
      fsdp += 2 * (f - 1) / f * b
  act = BATCH // (R * f) * SEQ * LM["d_model"] * 4
  tensor = LM["num_layers"] * 5 * 2 * (t - 1) / t * act
  return {("fsdp",): fsdp, ("tensor",): tensor}


def lm_trainer(setup, method):
  layout, lm, params, specs, _ = setup
  return train.Trainer(models.lm_loss(lm), layout.optimizer(method, specs, lm.param_regather()),
                       layout.mesh, batch_axes=layout.batch_axes, param_specs=specs)


def compile_step(trainer, state, batch):
  compiled = trainer.step_fn(state, batch).lower(state, batch).compile()
  return compiled, comm.parse_hlo(compiled.as_text(), mesh=trainer.mesh)


def test_dp_over_replicas_equals_full_batch(setup):
  """One SGD(1) step of exact DP over replicas moves the parameters by the full-batch
  gradient; the replica axis carries one all-reduce of every shard, the inner axes the
  layout's traffic only."""
  layout, lm, params, specs, _ = setup
  batch = data.pydoc_text().batch(0, BATCH, seq_len=SEQ)
  plain = models.TransformerLM(**LM)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(models.lm_loss(plain)))(params, batch)
  trainer = lm_trainer(setup, optax.chain(sync.mean("replica"), optax.sgd(1.0)))
  state = trainer.init(params)
  compiled, report = compile_step(trainer, state, batch)
  new, per_device, sent = compiled(state, batch)
  m = trainer.measurements(per_device, sent)
  np.testing.assert_allclose(m["loss"], ref_loss, rtol=2e-6)
  grads = jax.tree.map(lambda a, b: a - b, host(params), host(new.params))
  chex.assert_trees_all_close(grads, host(ref_grads), atol=2e-6, rtol=1e-4)
  # Bytes: 2 (R-1)/R of every shard on replica (R = 2: the shard bytes themselves).
  want = {("replica",): float(sum(jax.tree.leaves(local_bytes(params, specs, layout.mesh)))),
          **layout_bytes(setup, lm.param_regather())}
  assert report.by_axis() == pytest.approx(want)
  assert int(sent) == pytest.approx(report.wire_bytes() - want[("tensor",)])


@pytest.fixture(scope="module")
def diloco_lm(setup):
  """DiLoCo over replicas of the sharded LM: the trainer, its compiled step, the report."""
  _, _, params, _, _ = setup
  trainer = lm_trainer(setup, local.diloco(optax.sgd(0.1), OUTER(), 2, "replica"))
  state = trainer.init(params)
  batches = [data.pydoc_text().batch(t, BATCH, seq_len=SEQ) for t in range(6)]
  compiled, report = compile_step(trainer, state, batches[0])
  return trainer, state, batches, compiled, report


def test_diloco_bytes_per_axis(setup, diloco_lm):
  """The replica axis carries DiLoCo's sync only (in the sync branch: one all-reduce of
  every shard of the parameters); fsdp and tensor carry the layout's traffic every step."""
  layout, lm, params, specs, _ = setup
  trainer, state, batches, compiled, report = diloco_lm
  inner = layout_bytes(setup, lm.param_regather())
  sync_bytes = float(sum(jax.tree.leaves(local_bytes(params, specs, layout.mesh))))
  assert report.by_axis() == pytest.approx({("replica",): sync_bytes, **inner})
  assert all(c.in_conditional for c in report.select(axes=("replica",)))
  assert not any(c.in_conditional for c in report if c.axes != ("replica",))
  sent = []
  for batch in batches[:2]:  # step 1 trains locally, step 2 syncs
    state, _, nbytes = compiled(state, batch)
    sent.append(int(nbytes))
  assert sent == pytest.approx([inner[("fsdp",)], inner[("fsdp",)] + sync_bytes])


@pytest.mark.slow
def test_diloco_checkpoint_resumes_bit_for_bit(setup, diloco_lm, tmp_path):
  """Save after 3 steps (per-replica parameters, sharded outer state), restore, run 3 more:
  the same bits as running 6 without stopping."""
  _, _, params, _, _ = setup
  trainer, _, batches, compiled, _ = diloco_lm
  state = trainer.init(params)
  for batch in batches[:3]:
    state, _, _ = compiled(state, batch)
  ckpt = train.Checkpointer(str(tmp_path), every=1, async_save=False)
  ckpt.save(state, force=True)
  for batch in batches[3:]:
    state, _, _ = compiled(state, batch)
  straight = host(state)
  restored, _ = ckpt.restore(trainer.program, trainer.init(params))
  ckpt.close()
  assert int(restored.step) == 3
  for batch in batches[3:]:
    restored, _, _ = compiled(restored, batch)
  chex.assert_trees_all_equal(host(restored), straight)


def compiled_argument_bytes(tree) -> int:
  """Per-device bytes of `tree` as the compiled memory analysis of a program reading it."""
  fn = jax.jit(lambda t: [jnp.sum(x) for x in jax.tree.leaves(t)])
  return fn.lower(tree).compile().memory_analysis().argument_size_in_bytes


@pytest.mark.parametrize("name,field", [("diloco", ("outer_params", "outer_state")),
                                        ("compressed_int8_ef", ("memory",))])
@pytest.mark.slow
def test_per_replica_state_is_sharded_like_the_parameters(setup, name, field):
  """DiLoCo's outer parameters and momentum, and int8's error memory, take per device 1/k
  of the unsharded copy, k = how many devices shard the leaves inside a replica: 1/4 for the
  group sharded over fsdp x tensor, 1/2 over one of them, 1 for the replicated norms."""
  layout, _, params, specs, _ = setup
  _, s, _, r = run_both(setup, name)[:4]
  whole_bytes = jax.tree.map(lambda x: 4 * x.size, params)
  shard_bytes = local_bytes(params, specs, layout.mesh)
  labels = jax.tree.map(parallel.sharding_label, specs, is_leaf=lambda x: isinstance(x, P))

  def state_of(groups, label):
    inner = groups.inner_states[label].inner_state  # by_sharding: one state per group
    inner = inner if name == "diloco" else inner[0]  # chain(compressed, sgd)
    return [getattr(inner, f) for f in field]

  for label, k in (("fsdp+tensor", 4), ("fsdp", 2), ("tensor", 2), ("replicated", 1)):
    mine = lambda tree: sum(b for b, l in zip(jax.tree.leaves(tree), jax.tree.leaves(labels))
                            if l == label)
    got = compiled_argument_bytes(state_of(s.opt_state.inner_state, label))  # inside zero()
    whole = compiled_argument_bytes(state_of(r.opt_state, label))
    assert got == len(field) * mine(shard_bytes), label
    assert whole == len(field) * mine(whole_bytes), label
    assert got * k == whole, label


# ------------------------------------------------------------------------------- ZeRO++
def device_chunks(trainer, params_tree, master, label, labels):
  """Per device: (its flat shard of the group's parameters, its master chunk) in numpy."""
  mesh = trainer.mesh
  coords = {d: dict(zip(mesh.axis_names, i)) for i, d in np.ndenumerate(mesh.devices)}
  leaves = [x for x, l in zip(jax.tree.leaves(params_tree), jax.tree.leaves(labels))
            if l == label]
  out = []
  for shard in master.addressable_shards:
    d = shard.device
    flat = np.concatenate([np.ravel(next(s.data for s in x.addressable_shards if s.device == d))
                           for x in leaves])
    m = shard.data.shape[-1]
    flat = np.pad(flat, (0, 2 * m - flat.size))
    r = coords[d]["replica"]
    out.append((flat[r * m:(r + 1) * m], np.asarray(shard.data).reshape(-1)))
  return out


def test_zeropp_slow_axis_carries_quantised_gradients_and_parameters(setup):
  """ZeRO++ over replicas: the replica axis carries one int8 reduce-scatter (qgZ) and one
  int8 all-gather (qwZ) per group of equally sharded leaves, and nothing else (no backward
  re-gather: hpZ keeps it on fsdp); the parameters are the master copy quantised, within
  half a step (block max / 127) per block of 64."""
  layout, lm, params, specs, _ = setup
  block = 64
  codec = codecs.uniform(8, block=block)
  zeropp = parallel.zero(optax.sgd(0.1), 1, "replica", codec, "ef", gather_codec=codec)
  trainer = lm_trainer(setup, zeropp)
  state = trainer.init(params)
  batch = data.pydoc_text().batch(0, BATCH, seq_len=SEQ)
  compiled, report = compile_step(trainer, state, batch)
  new, _, sent = compiled(state, batch)
  # Hand-derived replica bytes: a group's flat shard of n elements is split in R = 2 chunks
  # of m = ceil(n / 2); a chunk's int8 payload is m code bytes and a float32 scale per
  # block. Reduce-scatter (all-to-all): (R-1)/R * R payloads; all-gather: (R-1) payloads.
  shard_elems = jax.tree.map(lambda b: b // 4, local_bytes(params, specs, layout.mesh))
  labels = jax.tree.map(parallel.sharding_label, specs, is_leaf=lambda x: isinstance(x, P))
  slow = 0
  for label in set(jax.tree.leaves(labels)):
    n = sum(e for e, l in zip(jax.tree.leaves(shard_elems), jax.tree.leaves(labels))
            if l == label)
    m = -(-n // R)
    slow += 2 * (m + 4 * -(-m // block))
  inner = layout_bytes(setup, lm.param_regather())
  assert report.by_axis() == pytest.approx({("replica",): slow, **inner})
  assert {(c.op, c.dtype) for c in report.select(axes=("replica",))} == {
      ("all-to-all", "u8"), ("all-gather", "u8")}
  assert int(sent) == pytest.approx(slow + inner[("fsdp",)])
  # qwZ: each device's parameters are its replica's master chunk, quantised.
  for label in ("fsdp+tensor", "replicated"):
    master = new.opt_state.inner_state.inner_states[label].inner_state.master
    for got, exact in device_chunks(trainer, new.params, master, label, labels):
      blocks = lambda x: np.pad(x, (0, -x.size % block)).reshape(-1, block)
      step = np.max(np.abs(blocks(exact)), axis=1) / 127
      err = blocks(np.abs(got - exact))
      assert np.all(err <= step[:, None] / 2 + 1e-6 * np.abs(exact).max()), label
      assert np.any(err > 0)  # it is quantised


# ------------------------------------------------------------ every method on the mesh
# Every method module of experiments/methods/, as the programs build it (`build.make_optimizer`
# and `build.task_loss` with the module's `wrap_loss`), with settings small enough that each
# syncs within 3 steps: {bundle: {label: experiments.compare-style entry}}.
PROGRAM_METHODS = {
    "every_step": {
        "dp": {}, "compressed": {"codec": "top_k:fraction=0.25", "memory": "ef"},
        "onebit_adam": {"freeze_step": 1}, "demo": {"chunk": 8, "k": 4}, "dpsgd": {},
        "choco": {"codec": "top_k:fraction=0.25"}, "zero": {}},
    # Whole matrices of sharded parameters (`ctx.param_specs`): inner-axis collectives too.
    "whole_matrices": {"powersgd": {}, "lq_sgd": {}, "muon": {},
                       "muloco": {"sync_every": 2, "bits": 2, "memory": "ef"},
                       "dion": {}, "dion2": {}, "muonbp": {"period": 2}},
    "local": {
        "local_sgd": {"sync_every": 2},
        "diloco_int8_ef": {"method": "diloco", "sync_every": 2, "codec": "uniform:bits=8",
                           "memory": "ef"},
        "streaming_diloco": {"sync_every": 2, "fragments": 2, "overlap": 1},
        "decoupled_diloco": {"sync_every": 2, "fragments": 2, "speeds": (1.0, 2.0)},
        "sparseloco": {"sync_every": 2, "density": 0.25, "chunk": 16},
        "dreamddp": {"sync_every": 2}, "scaffold": {"sync_every": 2},
        "hierarchical": {"sync_every": 2, "slow_axis": "replica", "fast_axis": None},
        "des_loc": {"sync_every": 2, "state_every": "mu=2,nu=4",
                    "optimizer": {"name": "adam", "lr": 1e-2}},
        "noloco": {"sync_every": 2},
        "factored_gossip_diloco": {"sync_every": 2},
        "gasloc": {"sync_every": 2, "momentum": 0.5},
        "pier": {"sync_every": 2, "warmup": 1},
        "diloco_eager_tokens": {"method": "diloco", "sync_every": 2, "eager": True,
                                "worker_steps": (2, 1), "weighting": "tokens"}},
    "overlap": {"delayed": {}, "stale_dc": {"method": "stale", "compensation": "dc"},
                "acco": {}},
}


def _library_methods():
  """name -> method over `replica` (with its optimiser) from the library itself: the codecs
  (one `compressed` each) and gradient coding, which no method module builds."""
  sgd = lambda: optax.sgd(0.1)
  c = lambda codec, **kw: optax.chain(
      sync.compressed(codec, axis_name="replica", **kw), sgd())
  key = jax.random.key(3)
  return {
      "codecs": {
          "cast": c(codecs.cast("bfloat16")), "int8_ef": c(codecs.uniform(8), memory="ef"),
          "qsgd": c(codecs.qsgd(), key=key), "sign_ef": c(codecs.sign(), memory="ef"),
          "top_k_ef21": c(codecs.top_k(0.25), memory="ef21"),
          "random_k": c(codecs.random_k(0.25), key=key),
          "rtop_k_ef": c(codecs.rtop_k(0.5, 0.25), memory="ef", key=key),
          "dct_top_k_ef": c(codecs.dct_top_k(8, 2), memory="ef"),
          "log_quant_loco": c(codecs.log_quant(4), memory="loco"),
          "fp4": c(codecs.fp4()), "fp8_two_phase": c(codecs.fp8(), collective="two_phase")},
      "every_step": {"gradient_coding": optax.chain(sync.gradient_coding(
          sync.fractional_repetition(R, 1), axis_name="replica"), sgd())},
  }


def _program_methods(layout, bundle, specs):
  """({label: transform}, wrap) of a bundle of PROGRAM_METHODS on `layout`'s mesh: each
  module's `build(settings, ctx)` over `replica`, and `wrap(loss)` applying every module's
  `wrap_loss` (ACCO's mean over micro-batches: one micro-batch here, the same value)."""
  methods, contexts = {}, []
  for label, entry in PROGRAM_METHODS.get(bundle, {}).items():
    base = _config.base_config()
    with base.unlocked():
      base.mesh, base.steps = MESH, 3
      base.optimizer.update({"name": "sgd", "lr": 0.1})
    c = _config.with_method(base, {"method": label, **entry})
    ctx = build.Context(config=c, inner=build.inner_optimizer(c), axis_name="replica",
                        num_workers=R, mesh_shape=dict(layout.mesh.shape),
                        key=jax.random.key(3), param_specs=specs)
    methods[label] = build.make_optimizer(c, ctx)
    contexts.append((c, ctx))

  def wrap(loss):
    for c, ctx in contexts:
      loss = build.task_loss(c, loss, ctx)
    return loss
  return methods, wrap


SMALL_SPECS = {"w": P("fsdp", "tensor"), "u": P("tensor", "fsdp"), "b": P(), "s": P()}


def _small_params(names):
  k = iter(jax.random.split(jax.random.key(4), 4 * len(names)))
  shapes = {"w": (16, 32), "u": (32, 16), "b": (32,), "s": (16,)}
  return {n: {leaf: jax.random.normal(next(k), shape) for leaf, shape in shapes.items()}
          for n in names}


def test_every_method_module_is_trained_on_replicas():
  """A method module of experiments/methods/ cannot skip the replica suite below."""
  named = {e.get("method", label) for bundle in PROGRAM_METHODS.values()
           for label, e in bundle.items()}
  assert named == set(build.available_methods())


@pytest.mark.parametrize("bundle", ["codecs", "every_step", "whole_matrices", "local",
                                    "overlap"])
@pytest.mark.slow
def test_every_method_runs_on_replicas_and_sends_only_over_replica(setup, bundle):
  """Every sync and local method (one per group of parameters, one compile per bundle) on
  replica x fsdp x tensor, the method modules built as the programs build them: every
  method's parameters move and stay finite in 3 steps (each syncs in them). The replica
  axis carries the methods' traffic, fsdp and tensor only the layout's: ZeRO-3's mean over
  fsdp of the replicated leaves' gradients, 2 (2-1)/2 x 4 x 48 = 192 bytes per method, and
  on tensor the sum of the loss's cotangent (a replicated term of the loss meets the
  tensor-sharded ones: one f32 all-reduce, 2 (2-1)/2 x 4 = 4 bytes); except the methods of
  whole matrices (PowerSGD, LQ-SGD, Muon, MuLoCo, Dion, Dion2, MuonBP), which reduce inside a
  replica too."""
  layout = setup[0]
  library = _library_methods().get(bundle, {})
  names = list(library) + list(PROGRAM_METHODS.get(bundle, {}))
  specs = {n: SMALL_SPECS for n in names}
  programs, wrap = _program_methods(layout, bundle, specs)
  methods = {**library, **programs}
  params = _small_params(names)
  labels = {n: {leaf: n for leaf in SMALL_SPECS} for n in names}
  tx = layout.optimizer(optax.multi_transform(methods, labels), specs)
  trainer = train.Trainer(wrap(linear_loss(layout_scales(layout, specs))), tx, layout.mesh,
                          batch_axes=layout.batch_axes, param_specs=specs,
                          batch_specs=jax.tree.map(lambda s: P("replica", *s), specs,
                                                   is_leaf=lambda s: isinstance(s, P)))
  state = trainer.init(params)
  grads = [host(jax.tree.map(lambda x, t=t: jnp.cos(t + jnp.arange(R * x.size)).reshape(
      R, *x.shape), params)) for t in range(3)]
  compiled, report = compile_step(trainer, state, grads[0])
  for g in grads:
    state, _, _ = compiled(state, g)
  chex.assert_tree_all_finite(state.params)
  for n in names:
    moved = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(state.params[n]), jax.tree.leaves(params[n]))]
    assert max(moved) > 1e-4, n
  by_axis = report.by_axis()
  assert by_axis[("replica",)] > 0
  if bundle == "whole_matrices":
    assert set(by_axis) <= {("replica",), ("fsdp",), ("tensor",), ("fsdp", "tensor")}
  else:
    assert set(by_axis) == {("replica",), ("fsdp",), ("tensor",)}
    assert by_axis[("fsdp",)] == 192 * len(methods) and by_axis[("tensor",)] == 4


# ------------------------------------------------------------------------------ donation
def test_donated_state_is_not_held_twice(setup):
  """The step donates the train state: the compiled program aliases every state buffer to
  its output, and its peak memory per device falls by exactly the state's bytes (DiLoCo:
  per-replica parameters and inner state, sharded outer parameters and momentum)."""
  layout = setup[0]
  specs = {"d": SMALL_SPECS}
  params = _small_params(["d"])
  batch = host(jax.tree.map(lambda x: jnp.ones((R, *x.shape)), params))
  peaks = {}
  for donate in (False, True):
    trainer = train.Trainer(
        linear_loss(layout_scales(layout, specs)),
        layout.optimizer(local.diloco(optax.adam(0.1), OUTER(), 4, "replica"), specs),
        layout.mesh, batch_axes=layout.batch_axes, param_specs=specs, donate=donate,
        batch_specs=jax.tree.map(lambda s: P("replica", *s), specs,
                                 is_leaf=lambda s: isinstance(s, P)))
    state = trainer.init(params)
    memory = trainer.step_fn(state, batch).lower(state, batch).compile().memory_analysis()
    state_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
    assert memory.alias_size_in_bytes == (state_bytes if donate else 0)
    peaks[donate] = memory.peak_memory_in_bytes
  assert peaks[False] - peaks[True] == state_bytes


def test_skip_nonfinite_outside_the_layout_skips_on_every_device(setup):
  """`skip_nonfinite` wraps `Layout.optimizer` with the batch axes; a NaN in one tensor
  shard of one replica's gradient makes every device skip (its agreement all-reduce spans
  the axes the gradient's shards differ over), so no shard moves."""
  layout = setup[0]
  specs = {"d": SMALL_SPECS}
  params = _small_params(["d"])
  tx = sync.skip_nonfinite(
      layout.optimizer(optax.chain(sync.mean("replica"), optax.sgd(0.1)), specs),
      layout.batch_axes)
  trainer = train.Trainer(linear_loss(layout_scales(layout, specs)), tx, layout.mesh,
                          batch_axes=layout.batch_axes, param_specs=specs,
                          batch_specs=jax.tree.map(lambda s: P("replica", *s), specs,
                                                   is_leaf=lambda s: isinstance(s, P)))
  state = trainer.init(params)
  bad = jax.tree.map(lambda x: np.ones((R, *x.shape), np.float32), params)
  bad["d"]["w"][0, 0, 0] = np.nan  # replica 0, the block of fsdp 0 and tensor 0
  state, m = trainer.step(state, bad)
  assert int(m["skipped_steps"]) == 1
  chex.assert_trees_all_equal(host(state.params), host(params))


def test_a_flat_vector_over_every_leaf_is_refused_with_the_fix(setup):
  """Without `by_sharding`, a codec's flat vector mixes the norms (replicated over tensor)
  with tensor shards: the norms would come back differing over tensor and lose the sum
  over tensor of their gradients. The Trainer refuses it when it is built (init)."""
  layout = setup[0]
  specs = {"d": SMALL_SPECS}
  tx = parallel.zero(optax.chain(sync.compressed(codecs.uniform(8), axis_name="replica"),
                                 optax.sgd(0.1)), 3, "fsdp", param_specs=specs)
  trainer = train.Trainer(linear_loss(layout_scales(layout, specs)), tx, layout.mesh,
                          batch_axes=layout.batch_axes, param_specs=specs)
  with pytest.raises(ValueError, match=r"differ over mesh axes \['tensor'\].*by_sharding"):
    trainer.init(_small_params(["d"]))
