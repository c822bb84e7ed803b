"""Flax NNX models in the Trainer, RNG keys and mutable state in the loss.

* The NNX LM trained with DP equals the linen LM from the same weights (values copied).
* An NNX MLP with Dropout and BatchNorm, with DP (both `mutable` modes) and with DiLoCo,
  equals a one-device reference that runs each worker's forward pass through NNX's own
  object API (a merged model whose dropout stream is set to
  fold_in(fold_in(stream key, step), worker)), so the per-worker keys, the per-worker or
  averaged statistics and the update rule are all checked.
* The same seed gives bit-identical runs; another dropout seed gives another run.
* A parameter-tree loss opts in to a key with `Trainer(key=...)`.
* Transforms see an NNX model's parameters exactly as a linen model's.
"""

import json
import os
import signal
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import faults
import nnx_runner
from jaxcomm import comm, data, local, models, sync, train

W = 8
B = 64  # 8 examples per worker
NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)
LM = dict(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=16)


def adam():
  # eps well above float32 noise: the gradient of a bias that BatchNorm follows is zero in
  # theory, and adam would turn its rounding noise into full-size steps.
  return optax.adam(1e-2, eps=1e-4)


def nnx_mlp(dropout_seed=1, dropout=0.3, batch_norm=True):
  return models.NnxMLP(64, hidden=(16,), num_classes=10, dropout=dropout,
                       batch_norm=batch_norm, rngs=nnx.Rngs(params=0, dropout=dropout_seed))


def digits_batches(steps):
  ds = data.digits()
  return [ds.batch(t, B) for t in range(steps)]


def blocks(batch):
  return [jax.tree.map(lambda x, w=w: x[w * (B // W):(w + 1) * (B // W)], batch)
          for w in range(W)]


def close(a, b, atol=1e-6):
  chex.assert_trees_all_close(a, b, atol=atol, rtol=1e-5)


# ------------------------------------------------------------------ the NNX LM
@pytest.mark.slow
def test_nnx_lm_with_dp_equals_linen_lm_from_the_same_weights(mesh8):
  lm = models.TransformerLM(**LM)
  params = lm.init(jax.random.key(0), jnp.zeros((1, LM["max_len"]), jnp.int32))
  nnx_lm = models.NnxTransformerLM(**LM, rngs=nnx.Rngs(1))  # other initial values ...
  nnx.update(nnx_lm, params["params"])                      # ... replaced by linen's
  tx = optax.chain(sync.mean("data"), optax.adam(1e-2))
  linen = train.Trainer(models.lm_loss(lm), tx, mesh8)
  ours = train.Trainer(models.nnx_lm_loss, tx, mesh8)
  a, b = linen.init(params), ours.init(nnx_lm)
  ds = data.pydoc_text()
  for t in range(5):
    batch = ds.batch(t, 16, seq_len=LM["max_len"])
    a, ma = linen.step(a, batch)
    b, mb = ours.step(b, batch)
    np.testing.assert_allclose(float(mb["loss"]), float(ma["loss"]), rtol=1e-6)
    assert int(mb["wire_bytes"]) == int(ma["wire_bytes"])
  close(b.params, a.params["params"])
  assert b.model_state == {}  # no variables besides the parameters


# ------------------------------------------------------------------ the one-device reference
class Reference:
  """W workers on one device through NNX's object API: merge, set the dropout stream to
  fold_in(fold_in(key, step), worker) with count 0, run; parameters stay `nnx.State`s."""

  def __init__(self, model):
    self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
    base = model.dropout.rngs.key.get_value()

    def loss(params, rest, step, worker, batch):
      rest = jax.tree.map(lambda x: x, rest)  # fresh Variables, mutable at this trace level
      m = nnx.merge(self.graphdef, params, rest)
      m.dropout.rngs.key.set_value(jax.random.fold_in(jax.random.fold_in(base, step), worker))
      m.dropout.rngs.count.set_value(jnp.zeros((), jnp.uint32))
      value, _ = models.nnx_classifier_loss(m, batch)
      return value, nnx.state(m, nnx.Not(nnx.Param))

    self.grad = jax.jit(jax.value_and_grad(loss, has_aux=True))

  def worker(self, params, rest, step, w, batch):
    """(loss, grads, variables after the forward pass) of worker w at `step`."""
    (value, new_rest), g = self.grad(params, rest, step, w, batch)
    return value, g, new_rest


def stats(rest):
  """The BatchNorm statistics of a variables state, as a pure dict."""
  return nnx.to_pure_dict(rest)["BatchNorm_0"]


def pure(state):
  return nnx.to_pure_dict(state)


def mean(trees):
  return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


def ref_dp(model, inner, batches, mutable):
  ref = Reference(model)
  p, opt = ref.params, inner.init(ref.params)
  rests = [ref.rest] * W
  for t, batch in enumerate(batches):
    outs = [ref.worker(p, rests[w], t, w, blocks(batch)[w]) for w in range(W)]
    u, opt = inner.update(mean([g for _, g, _ in outs]), opt, p)
    p = optax.apply_updates(p, u)
    rests = [r for _, _, r in outs]
    if mutable == "mean":
      # The statistics averaged (the RNG entries are rewritten before every use anyway).
      rests = [jax.tree.map(lambda *xs: sum(xs) / W if jnp.issubdtype(xs[0].dtype, jnp.floating)
                            else xs[0], *rests)] * W
  return pure(p), [stats(r) for r in rests]


@pytest.fixture(scope="module")
def dp_runs(mesh8):
  """DP on the Dropout + BatchNorm MLP, per-worker and averaged statistics, 3 steps."""
  runs = {}
  for mutable in ("per_worker", "mean"):
    trainer = train.Trainer(models.nnx_classifier_loss,
                            optax.chain(sync.mean("data"), adam()), mesh8,
                            has_aux=True, mutable=mutable)
    state = state0 = trainer.init(nnx_mlp())
    sent = []
    for batch in digits_batches(3):
      state, m = trainer.step(state, batch)
      sent.append(int(m["wire_bytes"]))
    runs[mutable] = trainer, state0, state, sent
  return runs


@pytest.mark.parametrize("mutable", ["per_worker", "mean"])
def test_dropout_batchnorm_dp_equals_the_one_device_reference(dp_runs, mutable):
  trainer, _, state, _ = dp_runs[mutable]
  params, ref_stats = ref_dp(nnx_mlp(), adam(), digits_batches(3), mutable)
  close(state.params, params)
  got = state.model_state["BatchNorm_0"]
  if mutable == "per_worker":  # one set of statistics per worker, each from its own rows
    data = frozenset({"data"})  # stored per worker: a leading axis over the data axis
    assert trainer.layout.model_state["BatchNorm_0"] == {"mean": data, "var": data}
    close(got, jax.tree.map(lambda *xs: jnp.stack(xs), *ref_stats))
    assert not np.allclose(got["mean"][0], got["mean"][1])
  else:  # replicated: the workers' statistics averaged every step
    assert trainer.layout.model_state["BatchNorm_0"] == {"mean": frozenset(),
                                                         "var": frozenset()}
    close(got, ref_stats[0])
  # The dropout stream keeps its base key: the step's keys are derived, never stored.
  base = nnx_mlp().dropout.rngs.key.get_value()
  assert (jax.random.key_data(state.model_state["dropout"]["rngs"]["key"]) ==
          jax.random.key_data(base)).all()


def test_averaged_statistics_bytes_counted_inspected_and_formula(dp_runs):
  _, _, _, per_worker_sent = dp_runs["per_worker"]
  trainer, state0, _, sent = dp_runs["mean"]
  n_params = 64 * 16 + 16 * 10 + 10 + 2 * 16  # Dense_0 (no bias), Dense_1, BatchNorm scale, bias
  n_stats = 2 * 16                                   # BatchNorm mean, var
  # Ring all-reduce of f32: 2 (W-1)/W x 4 bytes per element, one for the gradients and
  # one for the statistics.
  formula = lambda n: 2 * (W - 1) / W * 4 * n
  assert per_worker_sent == [formula(n_params)] * 3
  assert sent == [formula(n_params) + formula(n_stats)] * 3
  batch = digits_batches(1)[0]
  report = comm.inspect(trainer.step_fn(state0, batch), state0, batch)
  assert report.wire_bytes() == sent[0]


def ref_diloco(model, inner, outer, sync_every, batches):
  ref = Reference(model)
  theta = ref.params
  ps, rests = [theta] * W, [ref.rest] * W
  opts, o = [inner.init(theta)] * W, outer.init(theta)
  for t, batch in enumerate(batches):
    for w in range(W):
      _, g, rests[w] = ref.worker(ps[w], rests[w], t, w, blocks(batch)[w])
      u, opts[w] = inner.update(g, opts[w], ps[w])
      ps[w] = optax.apply_updates(ps[w], u)
    if (t + 1) % sync_every == 0:
      delta = mean([jax.tree.map(jnp.subtract, theta, p) for p in ps])
      step, o = outer.update(delta, o, theta)
      theta = optax.apply_updates(theta, step)
      ps = [theta] * W
  return [pure(p) for p in ps], [stats(r) for r in rests], pure(theta)


def test_dropout_batchnorm_diloco_equals_the_one_device_reference(mesh8):
  tx = local.diloco(adam(), NESTEROV, 2, axis_name="data")
  trainer = train.Trainer(models.nnx_classifier_loss, tx, mesh8, has_aux=True)
  state = trainer.init(nnx_mlp())
  batches = digits_batches(4)
  for batch in batches:
    state, _ = trainer.step(state, batch)
  ps, ref_stats, theta = ref_diloco(nnx_mlp(), adam(), NESTEROV, 2, batches)
  stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  close(state.params, stack(ps))
  close(state.opt_state.outer_params, theta)
  close(state.model_state["BatchNorm_0"], stack(ref_stats))
  model = trainer.model(state, worker=3)  # worker 3's parameters and statistics
  close(nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))["BatchNorm_0"], ref_stats[3])
  close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), ps[3])


# ------------------------------------------------------------------ determinism
def test_same_seed_is_bit_identical_and_the_dropout_seed_matters(dp_runs):
  trainer, _, reference, _ = dp_runs["per_worker"]
  batches = digits_batches(3)

  def run(dropout_seed):
    state = trainer.init(nnx_mlp(dropout_seed))  # a fresh model object, same compiled step
    for batch in batches:
      state, _ = trainer.step(state, batch)
    return state

  faults.assert_bitwise_equal(run(1), reference)
  other = run(2)
  assert not np.allclose(other.params["Dense_0"]["kernel"], reference.params["Dense_0"]["kernel"])


def test_parameter_tree_loss_opts_in_to_a_key(mesh8):
  """`Trainer(key=k)` calls loss(params, batch, step_key(k, step, worker))."""
  def loss(p, batch, key):  # inverted dropout on the input, by hand
    keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
    return jnp.mean((jnp.where(keep, 2 * batch["x"], 0) @ p["w"] - batch["y"]) ** 2)

  key = jax.random.key(7)
  trainer = train.Trainer(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh8, key=key)
  p = {"w": jnp.zeros((64, 1))}
  state = trainer.init(p)
  ds = data.digits()
  batches = [{"x": b["x"], "y": b["y"][:, None].astype(jnp.float32)}
             for b in (ds.batch(t, B) for t in range(3))]
  for batch in batches:
    state, _ = trainer.step(state, batch)
  grad = jax.jit(jax.grad(loss))
  for t, batch in enumerate(batches):
    keys = [jax.random.fold_in(jax.random.fold_in(key, t), w) for w in range(W)]
    g = mean([grad(p, b, k) for b, k in zip(blocks(batch), keys)])
    p = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
  close(state.params, p)
  with pytest.raises(ValueError, match="key"):
    train.Trainer(loss, optax.sgd(0.1), mesh8, key=7)
  with pytest.raises(ValueError, match="mutable"):
    train.Trainer(loss, optax.sgd(0.1), mesh8, mutable="sync")


@pytest.mark.slow
def test_sigkilled_dropout_run_resumes_bit_for_bit_and_continues_the_data_stream(tmp_path):
  """tests/nnx_runner.py (Dropout + BatchNorm, grain batches) killed before step 7 with a
  checkpoint of step 4 on disk, then run again, ends bit for bit where an uninterrupted run
  ends, having taken batches 4, 5, ... again after the restore."""
  cmd = [sys.executable, os.path.join(faults.ROOT, "tests", "nnx_runner.py"),
         f"--workdir={tmp_path}", "--steps=12"]
  env = dict(os.environ, PYTHONPATH=faults.ROOT, JAX_PLATFORMS="cpu")
  run = lambda args: subprocess.run(cmd + args, capture_output=True, text=True, timeout=300,
                                    cwd=faults.ROOT, env=env, check=False)
  killed = run(["--kill_at=7"])
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  resumed = run([])
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  trainer, model, batches = nnx_runner.task()
  reference, history = train.fit(trainer, trainer.init(model), batches.__getitem__, 12,
                                 log_every=1, progress=False)
  like = trainer.init(model)
  final, _ = train.Checkpointer(str(tmp_path / "checkpoints")).restore(trainer.program, like)
  faults.assert_bitwise_equal(final, reference)  # params, adam, statistics, RNG base keys
  taken = [json.loads(line) for line in (tmp_path / "batches.jsonl").read_text().splitlines()]
  assert [r["step"] for r in taken] == list(range(7)) + list(range(4, 12))
  assert all(r["sha"] == nnx_runner.fingerprint(batches[r["step"]]) for r in taken)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, 13))
  assert [r["loss"] for r in rows] == [h["loss"] for h in history]


# ------------------------------------------------------------------ every transform
@pytest.mark.parametrize("name", ["compressed_ef", "powersgd", "zero1"])
def test_transforms_see_nnx_parameters_as_linen_ones(mesh8, name):
  """The NNX MLP (no dropout, no BatchNorm) from the linen MLP's weights trains alike."""
  from jaxcomm import codecs, parallel
  tx = {"compressed_ef": lambda: optax.chain(
            sync.compressed(codecs.top_k(0.1), memory="ef", axis_name="data"), optax.sgd(0.1)),
        "powersgd": lambda: optax.chain(sync.powersgd(2, "data"), optax.sgd(0.1)),
        "zero1": lambda: parallel.zero(optax.adam(1e-2), 1, "data")}[name]()
  linen_model = models.MLP(hidden=(16,), num_classes=10)
  params = linen_model.init(jax.random.key(0), jnp.zeros((1, 64)))
  ours = nnx_mlp(dropout=0.0, batch_norm=False)
  nnx.update(ours, params["params"])
  a_tr = train.Trainer(models.classifier_loss(linen_model), tx, mesh8, has_aux=True)
  b_tr = train.Trainer(models.nnx_classifier_loss, tx, mesh8, has_aux=True)
  a, b = a_tr.init(params), b_tr.init(ours)
  for batch in digits_batches(3):
    a, ma = a_tr.step(a, batch)
    b, mb = b_tr.step(b, batch)
    assert int(ma["wire_bytes"]) == int(mb["wire_bytes"]) > 0
  close(b.params, a.params["params"])
  assert jax.tree.leaves(b_tr.layout.opt_state) == jax.tree.leaves(a_tr.layout.opt_state)
