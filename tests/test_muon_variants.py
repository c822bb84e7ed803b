"""Dion2 (`sync.dion2`) and MuonBP (`sync.muonbp`): float64 references of the papers' rules on
one device and on `replica=2,fsdp=2,tensor=2` (three small sharded matrices), the reductions to
`sync.muon` (alpha = 1, P = 1), bytes per axis counted == compiled == derived by hand."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import parallel, sync, train
from tests.test_dion import adamw_step
from tests.test_replicas import MESH, R, compile_step, gradients, host, layout_scales
from tests.test_replicas import linear_loss

LR, BLOCK_LR, WD, BETA = 0.05, 0.03, 0.01, 0.9
STEPS = 4


def newton_schulz(x, steps=5, eps=1e-8):
  """Muon's quintic iteration (optax's coefficients) in float64, on the shorter side."""
  a, b, c = 3.4445, -4.7750, 2.0315
  flip = x.shape[0] > x.shape[1]
  x = x.T if flip else x
  x = x / (np.linalg.norm(x) + eps)
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if flip else x


def scale(shape):
  """optax's shape scale of a fan_in x fan_out kernel."""
  return math.sqrt(max(1.0, shape[1] / shape[0]))


def _run(params, grads, matrix_rule):
  """Runs `matrix_rule(name, t, x, g) -> update` on the 2-D leaves and AdamW (optax's
  defaults, b2 0.999) on the others; x <- x (1 - lr wd) - lr_t update for the matrices."""
  x = {k: np.asarray(v, np.float64) for k, v in params.items()}
  adam = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in x.items() if v.ndim != 2}
  for t, g in enumerate(grads, start=1):
    for k in x:
      gk = np.asarray(g[k], np.float64)
      if k in adam:
        x[k], adam[k] = adamw_step(x[k], gk, adam[k], t, LR, b2=0.999)
      else:
        lr, upd = matrix_rule(k, t, x[k], gk)
        x[k] = x[k] * (1 - lr * WD) - lr * upd
  return x


def dion2_reference(params, grads, fraction, ef, shards=None):
  """Dion2 (arXiv 2512.16928): accumulate, select the top ceil(alpha d) slices of the shorter
  side by L1 norm (of each of shards[k] equal parts of it with a sharded rule), orthogonalise
  them, decay them in the accumulator, update only them."""
  acc = {}

  def rule(k, t, x, g):
    flip = x.shape[0] > x.shape[1]
    m = acc.get(k, 0.0) + (g.T if flip else g)
    norms = np.abs(m).sum(axis=1)
    parts = (shards or {}).get(k, 1)
    size = len(norms) // parts
    take = math.ceil(fraction * (size if parts > 1 else len(norms)))
    sel = np.concatenate([p * size + np.argsort(-norms[p * size:(p + 1) * size],
                                                kind="stable")[:take] for p in range(parts)])
    upd = np.zeros_like(m)
    upd[sel] = newton_schulz(m[sel])
    m[sel] *= ef
    acc[k] = m
    return LR, scale(x.shape) * (upd.T if flip else upd)

  return _run(params, grads, rule)


def muonbp_reference(params, grads, period, blocks):
  """MuonBP (arXiv 2510.16981) without Nesterov: EMA momentum; update t orthogonalises the
  whole matrix at `LR` when P divides t, else each block of the blocks[k] = (rows, cols) grid
  on its own, scaled by its own shape, at `BLOCK_LR`."""
  mom = {}

  def rule(k, t, x, g):
    m = mom[k] = BETA * mom.get(k, 0.0) + (1 - BETA) * g
    if t % period == 0:
      return LR, scale(m.shape) * newton_schulz(m)
    rows, cols = blocks.get(k, (1, 1))
    out = [[scale(b.shape) * newton_schulz(b) for b in np.split(r, cols, axis=1)]
           for r in np.split(m, rows, axis=0)]
    return BLOCK_LR, np.block(out)

  return _run(params, grads, rule)


# --------------------------------------------------------------------------- one device
def _params():
  return {"a": jax.random.normal(jax.random.key(0), (6, 4)),
          "b": jnp.linspace(-1.0, 1.0, 4),
          "c": jax.random.normal(jax.random.key(1), (3, 8))}


def _one_device(tx, params, grads):
  state, update = tx.init(params), jax.jit(tx.update)
  for g in grads:
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
  return host(params)


def _sin_grads(params, steps=STEPS):
  return [jax.tree.map(lambda x: jnp.sin((t + 1) * x), params) for t in range(steps)]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_dion2_one_device_equals_the_papers_rule(fraction):
  params = _params()
  grads = _sin_grads(params)
  got = _one_device(sync.dion2(LR, fraction, ef_decay=BETA, weight_decay=WD), params, grads)
  chex.assert_trees_all_close(got, dion2_reference(params, grads, fraction, BETA),
                              rtol=1e-4, atol=1e-5)


def test_dion2_at_alpha_1_is_muon_without_nesterov():
  params = _params()
  grads = _sin_grads(params)
  got = _one_device(sync.dion2(LR, 1.0, ef_decay=BETA, weight_decay=WD), params, grads)
  want = _one_device(sync.muon(LR, beta=BETA, nesterov=False, weight_decay=WD), params, grads)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_muonbp_with_period_1_is_muon_bit_for_bit():
  params = _params()
  grads = _sin_grads(params)
  got = _one_device(sync.muonbp(LR, 1, BLOCK_LR, weight_decay=WD), params, grads)
  chex.assert_trees_all_equal(got, _one_device(sync.muon(LR, weight_decay=WD), params, grads))


def test_bad_arguments_fail_when_built():
  for make, word in [(lambda: sync.dion2(LR, 0.0), "fraction"),
                     (lambda: sync.dion2(LR, 1.5), "fraction"),
                     (lambda: sync.dion2(LR, 0.5, selection="all"), "selection"),
                     (lambda: sync.dion2(LR, 0.5, ef_decay=2.0), "ef_decay"),
                     (lambda: sync.muonbp(LR, 0), "period"),
                     (lambda: sync.muonbp(LR, 2.5), "period"),
                     (lambda: sync.muonbp(LR, 2, -1.0), "block_learning_rate"),
                     (lambda: sync.muonbp(LR, 2, strategy="all"), "strategy"),
                     (lambda: sync.muonbp(LR, 2, bogus=1), "bogus")]:
    with pytest.raises(ValueError, match=word):
      make()


# ------------------------------------------------- replica=2, fsdp=2, tensor=2, small matrices
SPECS = {"a": P("fsdp", "tensor"),   # 8 x 16: rows (the shorter side) split over fsdp
         "b": P("tensor", "fsdp"),   # 16 x 8: columns (the shorter side) split over fsdp
         "c": P(None, "fsdp"),       # 8 x 24: rows (the shorter side) whole
         "e": P("tensor")}           # 16: AdamW
SHAPES = {"a": (8, 16), "b": (16, 8), "c": (8, 24), "e": (16,)}


@pytest.fixture(scope="module")
def mesh_setup():
  layout = parallel.Layout(parallel.make_mesh(MESH))
  params = {k: jax.random.normal(jax.random.key(i), s) for i, (k, s) in enumerate(SHAPES.items())}
  return layout, params, gradients(params, STEPS)


def _sharded_run(mesh_setup, tx):
  """(trainer, final state, compiled report, counted bytes per step, mean-gradient params)."""
  layout, params, grads = mesh_setup
  batch_specs = {k: P("replica", *s) for k, s in SPECS.items()}
  trainer = train.Trainer(linear_loss(layout_scales(layout, SPECS)),
                          layout.optimizer(tx, SPECS), layout.mesh,
                          batch_axes=layout.batch_axes, param_specs=SPECS,
                          batch_specs=batch_specs)
  state = trainer.init(params)
  compiled, report = compile_step(trainer, state, grads[0])
  sent = []
  for g in grads:
    before = _counted(state.opt_state)
    state, _, _ = compiled(state, g)
    sent.append({k: c - before.get(k, 0) for k, c in _counted(state.opt_state).items()})
  fsdp = trainer.mesh.shape["fsdp"]
  replicas = [host(trainer.worker_view(state.params, trainer.layout.params, r * fsdp))
              for r in range(R)]
  return report, sent, replicas


def _counted(opt_state) -> dict:
  out = {}
  for x in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(
      s, (sync.Dion2State, sync.MuonState, sync.MeanState))):
    if isinstance(x, sync.MeanState):
      counters = {"mean": x.wire_bytes}
    elif isinstance(x, (sync.Dion2State, sync.MuonState)):
      counters = x.wire_bytes
    else:
      continue
    for label, c in counters.items():
      out[label] = out.get(label, 0) + int(np.asarray(c).reshape(-1)[0])
  return out


def _mean(grads):
  return [jax.tree.map(lambda x: np.mean(x, axis=0), g) for g in grads]


# Hand-derived bytes per step of one device (float32). Local blocks: a 4 x 8, b 8 x 4, c 8 x 12,
# e 8. The replicas' mean gradient: all-reduce (R = 2) of the 168 local floats. The layout:
# ZeRO-3's mean over fsdp of e (8 floats, not split over fsdp) and autodiff's 4 bytes on tensor.
MEAN = 4 * (32 + 32 + 96 + 8)
LAYOUT = {("fsdp",): 32.0, ("tensor",): 4.0}
# Dion2 at alpha = 1/4. The slices' L1 norms summed over the other side's axes: a's and b's 4
# over tensor (16 bytes each), c's 8 over fsdp (32). Global: a's and b's norms gathered over
# fsdp (16 bytes each); the owner all-to-alls (a and b on fsdp x tensor, c on fsdp) carry
# min(k = 2, 4) slices of a and b per device (16 floats: width 16, 3/4 of 4 x 16 x 4 bytes,
# in and out) and c's k = 2 of its 8 whole rows (24 floats: 1/2 of 2 x 24 x 4, in and out).
# Local: one slice of a's and b's 4 per device (width 8), c as above.
DION2 = {
    "global": {"tensor": 2 * 16, "fsdp": 32 + 2 * 16 + 2 * 96, "fsdp+tensor": 2 * 192},
    "local": {"tensor": 2 * 16, "fsdp": 32 + 2 * 96, "fsdp+tensor": 2 * 96},
}
# Muon's owner all-to-alls (MuonBP's full steps): a and b (32 floats each, width 32) and c (96).
OWNER = {"fsdp+tensor": 2 * 0.75 * 4 * 32 * 4, "fsdp": 2 * 0.5 * 2 * 96 * 4}


@pytest.fixture(scope="module")
def dion2_runs(mesh_setup):
  return {sel: _sharded_run(mesh_setup, sync.dion2(
      LR, 0.25, ef_decay=BETA, selection=sel, weight_decay=WD, axis_name="replica",
      param_specs=SPECS)) for sel in ("global", "local")}


@pytest.mark.slow
@pytest.mark.parametrize("selection", ["global", "local"])
def test_dion2_sharded_equals_the_reference(mesh_setup, dion2_runs, selection):
  """Global selection is the paper's rule on the whole matrices; local selection is the same
  rule applied to each fsdp shard of the selected side (a and b: 2 shards, c: whole)."""
  _, params, grads = mesh_setup
  shards = {"a": 2, "b": 2} if selection == "local" else None
  want = dion2_reference(params, _mean(grads), 0.25, BETA, shards)
  for got in dion2_runs[selection][2]:
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("selection", ["global", "local"])
def test_dion2_bytes_counted_compiled_and_by_hand(dion2_runs, selection):
  report, sent, _ = dion2_runs[selection]
  want = {label: nbytes for label, nbytes in DION2[selection].items()}
  assert sent == [dict(want, mean=MEAN)] * STEPS
  by_axis = {tuple(k.split("+")): b for k, b in want.items()}
  for axes, b in LAYOUT.items():
    by_axis[axes] = by_axis.get(axes, 0.0) + b
  by_axis[("replica",)] = MEAN
  assert report.by_axis() == pytest.approx(by_axis)
  owner = DION2[selection]["fsdp+tensor"] + 2 * 96
  assert owner < sum(OWNER.values())  # fewer bytes than Muon's owner all-to-alls


@pytest.fixture(scope="module")
def muonbp_run(mesh_setup):
  return _sharded_run(mesh_setup, sync.muonbp(
      LR, 2, BLOCK_LR, nesterov=False, beta=BETA, weight_decay=WD, axis_name="replica",
      param_specs=SPECS))


@pytest.mark.slow
def test_muonbp_sharded_equals_the_reference(mesh_setup, muonbp_run):
  """Period 2 over 4 steps: block steps 1 and 3 orthogonalise a's 2 x 2 grid of blocks (fsdp x
  tensor), b's 2 x 2 and c's 1 x 2 (fsdp) each on its own device."""
  _, params, grads = mesh_setup
  want = muonbp_reference(params, _mean(grads), 2, {"a": (2, 2), "b": (2, 2), "c": (1, 2)})
  for got in muonbp_run[2]:
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_muonbp_bytes_on_block_and_full_steps(muonbp_run):
  """Full steps (2 and 4) send the owner all-to-alls, block steps (1 and 3) nothing inside the
  replica; the compiled step holds both, the all-to-alls inside the conditional."""
  report, sent, _ = muonbp_run
  block, full = {"mean": MEAN, "fsdp": 0, "fsdp+tensor": 0}, dict(OWNER, mean=MEAN)
  assert sent == [block, full, block, full]
  want = {("fsdp",): LAYOUT[("fsdp",)] + OWNER["fsdp"], ("tensor",): LAYOUT[("tensor",)],
          ("fsdp", "tensor"): OWNER["fsdp+tensor"], ("replica",): MEAN}
  assert report.by_axis() == pytest.approx(want)
  assert all(c.in_conditional for c in report.select(axes=("fsdp", "tensor")))
