"""Muon over sharded parameters (`sync.muon`) and MuLoCo (`local.muloco`).

On one device `sync.muon` is `optax.contrib.muon` bit for bit. On `replica=2,fsdp=2,tensor=2`
both strategies (owner-based, Gram all-reduces) give the parameters of `optax.contrib.muon`
under plain `jax.jit` with the same NamedShardings, and their bytes per axis, counted in the
state, equal the compiled program's and a hand derivation.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import comm, local, models, parallel, sync, train
from tests.test_replicas import LM, MESH, R, compile_step, gradients, host, layout_scales
from tests.test_replicas import linear_loss, run_against_unsharded

LR = 0.05
STEPS = 3


def _params():
  return {"w": jax.random.normal(jax.random.key(0), (6, 4)),
          "v": jax.random.normal(jax.random.key(1), (3, 8)),
          "t": jax.random.normal(jax.random.key(2), (2, 3, 4)),
          "b": jnp.linspace(-1.0, 1.0, 4)}


def _run_one_device(tx, params, steps=STEPS):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(steps):
    grads = jax.tree.map(lambda x: jnp.sin((t + 1) * x), params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("strategy", ["owner", "gram"])
@pytest.mark.parametrize("kwargs", [dict(weight_decay=0.01),
                                    dict(nesterov=False, consistent_rms=0.2)])
def test_one_device_is_optax_muon(strategy, kwargs):
  """Unsharded, both strategies are optax.contrib.muon bit for bit (matrices by Newton-Schulz,
  the 1-D and 3-D leaves by AdamW)."""
  params = _params()
  got = _run_one_device(sync.muon(LR, strategy=strategy, **kwargs), params)
  want = _run_one_device(optax.contrib.muon(LR, **kwargs), params)
  chex.assert_trees_all_equal(got, want)


def test_dimension_numbers_as_optax():
  """A 3-D leaf orthogonalised as a batch of matrices (optax's MuonDimensionNumbers)."""
  params = _params()
  dn = {"w": optax.contrib.MuonDimensionNumbers(), "v": None, "b": None,
        "t": optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)}
  got = _run_one_device(sync.muon(LR, muon_weight_dimension_numbers=dn), params)
  want = _run_one_device(optax.contrib.muon(LR, muon_weight_dimension_numbers=dn), params)
  chex.assert_trees_all_equal(got, want)


def test_bad_arguments_fail_at_construction():
  with pytest.raises(ValueError, match="strategy"):
    sync.muon(LR, strategy="allgather")
  with pytest.raises(ValueError, match="ns_coeffs"):
    sync.muon(LR, ns_coeffs=(1.0, 2.0))
  with pytest.raises(ValueError, match="ns_steps"):
    sync.muon(LR, ns_steps=0)


# ----------------------------------------------------------- replicas of a sharded model
@pytest.fixture(scope="module")
def setup():
  layout = parallel.Layout(parallel.make_mesh(MESH))
  lm = models.TransformerLM(**LM, layout=layout)
  params = models.TransformerLM(**LM).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  specs = layout.param_specs(lm.param_axes(), params)
  return layout, params, specs, gradients(params, STEPS)


def _trainer(setup, method):
  layout, _, specs, _ = setup
  batch_specs = jax.tree.map(lambda s: P("replica", *s), specs,
                             is_leaf=lambda s: isinstance(s, P))
  return train.Trainer(linear_loss(layout_scales(layout, specs)),
                       layout.optimizer(method, specs), layout.mesh,
                       batch_axes=layout.batch_axes, param_specs=specs, batch_specs=batch_specs)


@pytest.fixture(scope="module")
def runs(setup):
  """strategy -> (trainer, state after STEPS steps, compiled report, counted bytes per step)."""
  _, params, specs, grads = setup
  out = {}
  for strategy in ("owner", "gram"):
    trainer = _trainer(setup, sync.muon(LR, strategy=strategy, axis_name="replica",
                                        param_specs=specs))
    state = trainer.init(params)
    compiled, report = compile_step(trainer, state, grads[0])
    for g in grads:
      state, _, _ = compiled(state, g)
    out[strategy] = trainer, state, report
  return out


@pytest.fixture(scope="module")
def auto_partitioned(setup):
  """(c): optax.contrib.muon under plain jax.jit, parameters with the same NamedShardings,
  on the replicas' mean gradient; (parameters, the compiled step's collectives)."""
  layout, params, specs, grads = setup
  ref = optax.contrib.muon(LR)
  put = lambda tree: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(layout.mesh, s)),
                                  tree, specs, is_leaf=lambda s: isinstance(s, P))

  @jax.jit
  def step(p, s, g):
    updates, s = ref.update(g, s, p)
    return optax.apply_updates(p, updates), s

  p = put(params)
  s = ref.init(p)
  for g in grads:
    mean = put(jax.tree.map(lambda x: np.mean(x, axis=0), g))
    report = comm.parse_hlo(step.lower(p, s, mean).compile().as_text(), mesh=layout.mesh)
    p, s = step(p, s, mean)
  return host(p), report


@pytest.mark.parametrize("strategy", ["owner", "gram"])
@pytest.mark.slow
def test_sharded_strategies_equal_auto_partitioned_optax(setup, runs, auto_partitioned,
                                                         strategy):
  """(a) owner-based and (b) Gram all-reduces give, on every replica, the parameters of (c)
  optax.contrib.muon under jax.jit with the same shardings (rtol 1e-5), after 3 steps."""
  _, params, _, _ = setup
  trainer, state, _ = runs[strategy]
  want, _ = auto_partitioned
  fsdp = trainer.mesh.shape["fsdp"]
  for replica in range(R):
    got = host(trainer.worker_view(state.params, trainer.layout.params, replica * fsdp))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  moved = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), want, host(params))
  assert min(jax.tree.leaves(moved)) > 1e-2  # every leaf moved (Muon and AdamW ones)


def test_momentum_is_sharded_like_the_parameters(setup, runs):
  """Muon's momentum of each matrix is stored per device as the parameter's block (1/4 of
  fc_in's 32x64 on fsdp x tensor, 1/2 of the embedding on fsdp), not gathered whole."""
  layout, params, specs, _ = setup
  block = {}
  for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(
      specs, is_leaf=lambda s: isinstance(s, P))):
    block[x.shape] = NamedSharding(layout.mesh, spec).shard_shape(x.shape)
  _, state, _ = runs["owner"]
  found = []
  for muon_state in jax.tree.leaves(state.opt_state,
                                    is_leaf=lambda s: isinstance(s, sync.MuonState)):
    if isinstance(muon_state, sync.MuonState):
      for mu in jax.tree.leaves(muon_state.mu):
        found.append(mu.shape)
        assert mu.addressable_shards[0].data.shape == block[mu.shape], mu.shape
  assert sorted(found) == sorted([(32, 64), (64, 32), (256, 32), (32, 256), (8, 32)])


def _counted_per_axis(opt_state) -> dict:
  """Bytes per axes label summed over every MuonState counter (and the mean's, on replica)."""
  out = {}
  for x in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, (sync.MuonState,
                                                                       sync.MeanState))):
    if isinstance(x, sync.MuonState):
      for label, counter in x.wire_bytes.items():
        out[label] = out.get(label, 0) + int(np.asarray(counter).reshape(-1)[0])
    elif isinstance(x, sync.MeanState):
      out["replica"] = out.get("replica", 0) + int(np.asarray(x.wire_bytes).reshape(-1)[0])
  return out


# Hand-derived bytes per step of one device (float32; LM d=32, d_ff=64, vocab 256, len 8).
# Matrix leaves (2-D), local blocks: fc_in 32x64 / (fsdp, tensor) and fc_out 64x32 /
# (tensor, fsdp): 16x32 = 512 elements; embed 256x32 / (-, fsdp): 256x16; head 32x256 /
# (fsdp, -): 16x256; pos 8x32 / (-, fsdp): 8x16.
LAYOUT = {("fsdp",): 2112.0, ("tensor",): 4.0}  # ZeRO-3's mean over fsdp of the 528 floats
# not sharded over fsdp (2 (F-1)/F * 2112); autodiff's cotangent over tensor
REPLICA = 43712.0  # the replicas' mean: all-reduce (R=2) of the 10928 floats of the shards
OWNER = {
    # fc_in -> device 0, fc_out -> device 1 of fsdp x tensor: all-to-all of 4 x 512 floats
    # (8192 bytes), 3/4 of it sent, in and out.
    ("fsdp", "tensor"): 2 * 0.75 * 8192,
    # embed (4096) -> 0, head (4096) -> 1, pos (128) -> 0: width 4224 floats; all-to-all of
    # 2 x 4224 floats, half of it sent, in and out.
    ("fsdp",): 2 * 0.5 * 2 * 4224 * 4,
}
GRAM = {
    # Per iteration (5): fc_in and fc_out (32 rows over fsdp, 64 columns over tensor): rows
    # gathered over fsdp (a 16x32 block: 2048 bytes) and the 32x32 Gram matrix (4096 bytes)
    # all-reduced over tensor (2 (2-1)/2 of it); embed and head (transposed: 32 rows over
    # fsdp, 256 columns): a 16x256 block (16384 bytes) gathered; pos (8 rows, 32 columns
    # over fsdp): the 8x8 Gram matrix (256 bytes) all-reduced over fsdp. Per step each
    # matrix's squared norm (4 bytes) is all-reduced over its axes (2 (n-1)/n * 4).
    ("fsdp",): 5 * (2 * 2048 + 2 * 16384 + 256) + 3 * 4.0,
    ("tensor",): 5 * 2 * 4096.0,
    ("fsdp", "tensor"): 2 * 2 * 0.75 * 4,
}


@pytest.mark.parametrize("strategy,muon_bytes", [("owner", OWNER), ("gram", GRAM)])
def test_bytes_per_axis_counted_compiled_and_by_hand(runs, strategy, muon_bytes):
  """Counted in the state == the compiled step's collectives == the hand derivation, axis by
  axis; the owner-based strategy moves fewer bytes than the Gram all-reduces on fsdp."""
  _, state, report = runs[strategy]
  want = dict(LAYOUT)
  for axes, nbytes in muon_bytes.items():
    want[axes] = want.get(axes, 0.0) + nbytes
  want[("replica",)] = REPLICA
  assert report.by_axis() == pytest.approx(want)
  counted = _counted_per_axis(state.opt_state)
  expect = {"+".join(axes): STEPS * b for axes, b in muon_bytes.items()}
  expect["replica"] = STEPS * REPLICA
  assert counted == pytest.approx(expect)
  assert OWNER[("fsdp",)] + OWNER[("fsdp", "tensor")] < GRAM[("fsdp",)]


# ------------------------------------------------------------------------------- MuLoCo
def test_muloco_one_worker_h1_outer_sgd1_is_muon():
  """K = 1, H = 1, outer SGD(1.0): MuLoCo is one-worker Muon (up to the rounding of
  θ_out − (θ_out − θ), an ulp per step)."""
  params = _params()
  got = _run_one_device(local.muloco(LR, sync_every=1, axis_name=None, outer=optax.sgd(1.0)),
                        params)
  want = _run_one_device(sync.muon(LR), params)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="memory"):
    local.muloco(LR, memory="ef")
  with pytest.raises(ValueError, match="bits"):
    local.muloco(LR, bits=1)


H = 2
BLOCK = 8  # every local last dimension is a multiple of 8: blocks equal sharded or not


@pytest.fixture(scope="module")
def muloco_runs(setup):
  """K = 2 replicas of the sharded LM, H = 2, 2-bit outer gradients with error feedback,
  owner-based Muon inside each replica; and 2 unsharded workers running the same."""
  layout, params, specs, grads = setup
  grads = gradients(params, 2 * H)  # 2 syncs
  method = lambda s: local.muloco(LR, H, "replica", param_specs=s, bits=2, block=BLOCK,
                                  memory="ef")
  trainer = _trainer(setup, method(specs))
  mesh2 = parallel.make_mesh({"replica": R}, devices=jax.devices()[:R])
  return (trainer, *run_against_unsharded(trainer, method, params, specs, mesh2, grads))


@pytest.mark.slow
def test_muloco_sharded_replicas_equal_unsharded_workers(setup, muloco_runs):
  """Each replica's parameters after 2 syncs (2-bit + EF outer gradients) equal those of 2
  unsharded workers; the replicas differ from each other between syncs."""
  trainer, state, ref, ref_state = muloco_runs[:4]
  fsdp = trainer.mesh.shape["fsdp"]
  for replica in range(R):
    got = host(trainer.worker_view(state.params, trainer.layout.params, replica * fsdp))
    want = host(ref.worker_view(ref_state.params, ref.layout.params, replica))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  _, params, _, _ = setup
  moved = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), want, host(params))
  assert min(jax.tree.leaves(moved)) > 1e-2


@pytest.mark.slow
def test_muloco_bytes(setup, muloco_runs):
  """Replica axis, per sync: every group's 2-bit payload gathered from the other worker: n/4
  code bytes + 4 bytes per block of 8 = 0.75 n bytes for the 10928 floats of the shards
  (every group's size is a multiple of 8); inner axes every step: the owner-based Muon's
  all-to-alls (OWNER) and the layout's. Counted == compiled == this."""
  *_, report, sent = muloco_runs
  sync_bytes = 0.75 * 10928
  want = dict(LAYOUT)
  for axes, nbytes in OWNER.items():
    want[axes] = want.get(axes, 0.0) + nbytes
  want[("replica",)] = sync_bytes
  assert report.by_axis() == pytest.approx(want)
  assert all(c.in_conditional for c in report.select(axes=("replica",)))
  inner = sum(OWNER.values()) + LAYOUT[("fsdp",)]
  layer = 3 * 41600  # ZeRO-3's counted gathers of the fsdp-sharded leaves (10400 floats)
  assert sent == pytest.approx([inner + layer, inner + layer + sync_bytes] * 2)
