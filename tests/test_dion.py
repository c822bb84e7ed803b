"""Dion (`sync.dion`): a one-device reference written from the paper, factor sync over the
replicas (`data=8`, and `replica=2,fsdp=2,tensor=2` with sharded factors), bytes per axis
counted == compiled == derived by hand, per-replica momenta, bad input."""

import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import parallel, sync, train
from tests.test_replicas import MESH, R, compile_step, gradients, host, layout_scales
from tests.test_replicas import linear_loss

LR, MU, WD, EPS = 0.05, 0.9, 0.01, 1e-8
STEPS = 3


def _params():
  return {"a": jax.random.normal(jax.random.key(0), (6, 4)),   # fan_in 6 > fan_out 4
          "b": jnp.linspace(-1.0, 1.0, 4),
          "c": jax.random.normal(jax.random.key(1), (3, 8))}   # transposed: P is 8 x r


def _grads(params, t, worker=0):
  return jax.tree.map(lambda x: jnp.sin((t + 1) * x + worker), params)


# ------------------------------------------------------------ the paper's rule, in numpy
def _qr(a):
  q, r = np.linalg.qr(a)
  return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def adamw_step(x, g, moments, t, lr, b1=0.9, b2=0.95, eps=EPS):
  """One AdamW step (no weight decay) in float64: (new x, new (m1, m2))."""
  m1, m2 = b1 * moments[0] + (1 - b1) * g, b2 * moments[1] + (1 - b2) * g * g
  step = (m1 / (1 - b1**t)) / (np.sqrt(m2 / (1 - b2**t)) + eps)
  return x - lr * step, (m1, m2)


def lion_step(x, g, moments, t, lr, b1=0.9, b2=0.95):
  """One Lion step (no weight decay) in float64: (new x, (m, unused))."""
  del t
  update = np.sign(b1 * moments[0] + (1 - b1) * g)
  return x - lr * update, (b2 * moments[0] + (1 - b2) * g, moments[1])


def dion_reference(params, grads, q0, scalar=adamw_step):
  """Dion (arXiv 2504.05295, Algorithm 1) in float64 on whole matrices, with the authors'
  scale sqrt(fan_out / fan_in), decoupled weight decay, and AdamW (betas 0.9, 0.95) on the
  other leaves (or `scalar`, e.g. Lion). `q0`: each matrix's first Q (m x r, of the matrix
  oriented longer side first)."""
  x = {k: np.asarray(v, np.float64) for k, v in params.items()}
  mom = {k: np.zeros((max(v.shape), min(v.shape))) for k, v in x.items() if v.ndim == 2}
  q = {k: np.asarray(v, np.float64) for k, v in q0.items()}
  adam = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in x.items() if v.ndim != 2}
  for t, g in enumerate(grads, start=1):
    for k, xk in x.items():
      gk = np.asarray(g[k], np.float64)
      if xk.ndim != 2:
        x[k], adam[k] = scalar(xk, gk, adam[k], t, LR)
        continue
      flip = xk.shape[0] < xk.shape[1]
      b = mom[k] + (gk.T if flip else gk)
      p = _qr(b @ q[k])
      r = b.T @ p
      mom[k] = b - (1 - MU) * p @ r.T
      q[k] = r / (np.linalg.norm(r, axis=0, keepdims=True) + EPS)
      u = p @ q[k].T
      x[k] = xk * (1 - LR * WD) - LR * np.sqrt(xk.shape[1] / xk.shape[0]) * (u.T if flip else u)
  return x


def _flat(tree):
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _first_q(params, rank, key=0):
  """Each matrix's first Q as documented: m x r standard normal from fold_in(key, crc32 of its
  tree path), m the shorter side."""
  out = {}
  for path, v in _flat(params).items():
    if v.ndim == 2:
      k = jax.random.fold_in(jax.random.key(key), zlib.crc32(path.encode()) & 0x7FFFFFFF)
      out[path] = np.asarray(jax.random.normal(k, (min(v.shape), min(rank, *v.shape))))
  return out


def _run_one_device(tx, params, grads):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads:
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _dion(**kw):
  return sync.dion(LR, mu=MU, weight_decay=WD, **kw)


@pytest.mark.parametrize("kw", [dict(rank=2), dict(rank_fraction=1.0),
                                dict(rank=1, scalar_optimizer="lion")])
def test_one_device_equals_the_papers_rule(kw):
  """Low rank (factors), full rank (the authors all-reduce the gradient there) and Lion for
  the vector: 3 steps of sync.dion equal the float64 reference, and every leaf moved. A zero
  gradient then moves no matrix and keeps Q (the warm start)."""
  params = _params()
  grads = [_grads(params, t) for t in range(STEPS)]
  tx = _dion(**kw)
  got, _ = _run_one_device(tx, params, grads)
  want = dion_reference(_flat(params), [_flat(g) for g in grads],
                        _first_q(params, kw.get("rank", 4)),
                        lion_step if kw.get("scalar_optimizer") == "lion" else adamw_step)
  chex.assert_trees_all_close(_flat(host(got)), want, rtol=1e-5, atol=1e-5)
  assert all(np.max(np.abs(want[k] - np.asarray(_flat(params)[k]))) > 1e-2 for k in want)
  first = tx.init(params)
  updates, new = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), first, params)
  for k in ("a", "c"):  # -lr wd x: the weight decay only
    np.testing.assert_allclose(updates[k], -LR * WD * params[k], rtol=1e-6, atol=1e-8)
  get = lambda s: optax.tree_utils.tree_get(s, "q")
  chex.assert_trees_all_equal(get(new), get(first))


def test_bad_arguments_fail_when_built():
  for kw, word in [(dict(rank=0), "rank"), (dict(rank=1.5), "rank"),
                   (dict(rank_fraction=0.0), "rank_fraction"),
                   (dict(rank_fraction=1.5), "rank_fraction"),
                   (dict(rank=2, rank_fraction=0.5), "rank"), (dict(mu=1.5), "mu"),
                   (dict(scalar_optimizer="sgd"), "scalar_optimizer"),
                   (dict(scalar_betas=(0.9,)), "scalar_betas")]:
    with pytest.raises(ValueError, match=word):
      sync.dion(0.1, **kw)
  with pytest.raises(ValueError, match="rank"):  # above min(n, m) = 3 of c (3 x 8)
    sync.dion(0.1, rank=4).init(_params())


# ------------------------------------------------------------------- factor sync, data=8
W = 8


@pytest.fixture(scope="module")
def data8(tmp_path_factory):
  """sync.dion over data=8 (every worker its own gradient), 3 steps of rank 2, the state after
  step 2 checkpointed: (trainer, state, report, reference, resume), where resume() restores the
  checkpoint and runs step 3 again."""
  mesh = parallel.make_mesh({"data": W})
  params = _params()
  grads = [jax.tree.map(lambda *xs: jnp.stack(xs), *[_grads(params, t, w) for w in range(W)])
           for t in range(STEPS)]
  tx = _dion(rank=2, axis_name="data")
  trainer = train.Trainer(linear_loss(jax.tree.map(lambda _: 1.0, params)), tx, mesh)
  state = trainer.init(params)
  compiled, report = compile_step(trainer, state, grads[0])
  ckpt = train.Checkpointer(str(tmp_path_factory.mktemp("dion")), every=2, async_save=False)
  for g in grads:
    state, _, _ = compiled(state, g)
    ckpt.save(state)
  mean = [_flat(jax.tree.map(lambda x: np.mean(x, axis=0), g)) for g in grads]

  def resume():
    restored, _ = ckpt.restore(trainer.program, trainer.init(params))
    saved = host(restored)  # the step donates the restored state
    return saved, compiled(restored, grads[-1])[0]

  return (trainer, state, report, dion_reference(_flat(params), mean, _first_q(params, 2)),
          resume)


@pytest.mark.slow
def test_factor_sync_over_8_workers_equals_the_reference_on_the_mean_gradient(data8):
  """Each worker keeps its own momentum; only P and R are averaged, yet the parameters are
  one-device Dion on the mean gradient (linearity), and the momenta differ per worker."""
  trainer, state, _, want, _ = data8
  chex.assert_trees_all_close(_flat(host(trainer.worker_view(state.params, trainer.layout.params,
                                                             3))), want, rtol=1e-5, atol=1e-5)
  momenta = host(optax.tree_utils.tree_get(state.opt_state, "momentum"))
  assert len(momenta) == 2 and all(m.shape[0] == W and np.any(m[0] != m[1]) for m in momenta)


@pytest.mark.slow
def test_per_worker_momenta_are_checkpointed_and_resume_bit_for_bit(data8):
  """The checkpoint of step 2 holds every worker's own momentum (they differ) and Q; step 3
  from the restored state equals the uninterrupted run bit for bit."""
  _, state, _, _, resume = data8
  restored, again = resume()
  assert int(restored.step) == 2
  momenta = optax.tree_utils.tree_get(restored.opt_state, "momentum")
  assert all(np.any(m[0] != m[1]) for m in momenta)
  chex.assert_trees_all_equal(host(again), host(state))


def _counted(opt_state) -> dict:
  """Bytes per axes label of every DionState counter (and the 1-D leaves' mean)."""
  out = {}
  for x in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, (sync.DionState,
                                                                       sync.MeanState))):
    counters = (x.wire_bytes if isinstance(x, sync.DionState) else
                {"mean": x.wire_bytes} if isinstance(x, sync.MeanState) else {})
    for label, c in counters.items():
      out[label] = out.get(label, 0) + int(np.asarray(c).reshape(-1)[0])
  return out


@pytest.mark.slow
def test_bytes_over_8_workers_counted_compiled_and_by_hand(data8):
  """2 (W-1)/W x 4 (n + m) r per matrix: a (6 x 4) and c (8 x 3) at r = 2, in two
  all-reduces (P's, R's); b's 4 floats in the mean of the other leaves."""
  _, state, report, _, _ = data8
  ring = lambda floats: 2 * (W - 1) / W * 4 * floats
  per_step = ring((6 + 4) * 2) + ring((8 + 3) * 2) + ring(4)
  assert per_step == 322.0
  assert report.by_axis() == pytest.approx({("data",): per_step})
  assert _counted(state.opt_state) == pytest.approx({"data": STEPS * (per_step - ring(4)),
                                                     "mean": STEPS * ring(4)})


# ----------------------------------------------- replica=2, fsdp=2, tensor=2: sharded factors
SPECS = {"a": P("fsdp", "tensor"),  # 8 x 16 -> 16 x 8: rows over tensor, columns over fsdp
         "b": P("tensor", "fsdp"),  # 16 x 8: rows over tensor, columns over fsdp
         "c": P(None, "fsdp"),      # 8 x 24 -> 24 x 8: rows over fsdp, columns whole
         "d": P(None, "fsdp"),      # 24 x 8: rows whole, columns over fsdp
         "e": P("tensor")}          # 16: AdamW
SHAPES = {"a": (8, 16), "b": (16, 8), "c": (8, 24), "d": (24, 8), "e": (16,)}


@pytest.fixture(scope="module")
def sharded():
  """Dion at rank 2 over the replicas of matrices sharded over fsdp x tensor, 3 steps; and the
  reference on the replicas' mean gradient."""
  layout = parallel.Layout(parallel.make_mesh(MESH))
  params = {k: jax.random.normal(jax.random.key(i), s) for i, (k, s) in enumerate(SHAPES.items())}
  grads = gradients(params, STEPS)
  tx = _dion(rank=2, axis_name="replica", param_specs=SPECS)
  trainer = train.Trainer(linear_loss(layout_scales(layout, SPECS)),
                          layout.optimizer(tx, SPECS), layout.mesh, batch_axes=layout.batch_axes,
                          param_specs=SPECS,
                          batch_specs={k: P("replica", *s) for k, s in SPECS.items()})
  state = trainer.init(params)
  compiled, report = compile_step(trainer, state, grads[0])
  for g in grads:
    state, _, _ = compiled(state, g)
  mean = [_flat(jax.tree.map(lambda x: np.mean(x, axis=0), g)) for g in grads]
  want = dion_reference(_flat(params), mean, _first_q(params, 2))
  return trainer, state, report, want


@pytest.mark.slow
def test_sharded_factors_equal_the_reference_on_the_mean_gradient(sharded):
  trainer, state, _, want = sharded
  fsdp = trainer.mesh.shape["fsdp"]
  for replica in range(R):
    got = host(trainer.worker_view(state.params, trainer.layout.params, replica * fsdp))
    chex.assert_trees_all_close(_flat(got), want, rtol=1e-5, atol=1e-5)


# Hand-derived bytes per step of one device, float32, rank 2. Oriented longer side first
# (n x m) with local blocks n_loc x m_loc: a, b 8 x 4; c 12 x 8; d 24 x 4. Per matrix:
# P = B Q summed over the column axes (an all-reduce's 2 (2-1)/2 x 4 n_loc r, as a
# reduce-scatter and an all-gather: a, b 64 on fsdp, d 192 on fsdp), P's rows gathered over
# the row axes for the QR ((2-1) x 4 n_loc r: a, b 64 on tensor, c 96 on fsdp), R = B^T P
# summed over the row axes (4 m_loc r: a, b 32 on tensor, c 64 on fsdp), R's column norms
# over the column axes (4 r: a, b, d 8 on fsdp). The replicas (R = 2) all-reduce the slice
# of P and R each device holds after the reduce-scatters (a, b: 4 + 2 rows; c: 12 + 4;
# d: 12 + 4), 4 (n + m) r / (the devices splitting the matrix): the unsharded formula
# 2 (R-1)/R x 4 (n + m) r shared by them; and e's 8 local floats (the other leaves' mean).
FSDP = 2 * (64 + 8) + (96 + 64) + (192 + 8)
TENSOR = 2 * (64 + 32)
FACTORS = 4 * 2 * (2 * (4 + 2) + (12 + 4) + (12 + 4))
OTHERS = 4 * 8
LAYOUT = {("fsdp",): 32.0, ("tensor",): 4.0}  # ZeRO-3's mean of e over fsdp; autodiff's


@pytest.mark.slow
def test_sharded_bytes_per_axis_counted_compiled_and_by_hand(sharded):
  _, state, report, _ = sharded
  assert (FSDP, TENSOR, FACTORS) == (504, 192, 352)
  assert FACTORS == sum(4 * (n + m) * 2 / k for n, m, k in [(16, 8, 4), (16, 8, 4),
                                                          (24, 8, 2), (24, 8, 2)])
  want = {("fsdp",): LAYOUT[("fsdp",)] + FSDP, ("tensor",): LAYOUT[("tensor",)] + TENSOR,
          ("replica",): FACTORS + OTHERS}
  assert report.by_axis() == pytest.approx(want)
  assert _counted(state.opt_state) == pytest.approx(
      {"fsdp": STEPS * FSDP, "tensor": STEPS * TENSOR, "replica": STEPS * FACTORS,
       "mean": STEPS * OTHERS})


@pytest.mark.slow
def test_momenta_are_per_replica_and_sharded_like_the_parameters(sharded):
  """Each matrix's momentum is stored with a leading axis over the replicas and the axes that
  split it (one block per device: a, b over fsdp x tensor, c, d over fsdp), and the two
  replicas' momenta differ."""
  _, state, _, _ = sharded
  momenta = [m for _, ms in optax.tree_utils.tree_get_all_with_path(state.opt_state, "momentum")
             for m in ms]
  assert sorted(m.shape[0] for m in momenta) == [R * 2] * 2 + [R * 4] * 2
  for m in momenta:
    blocks = np.asarray(m).reshape(R, -1, *m.shape[1:])
    assert np.any(blocks[0] != blocks[1])
