"""The step builder: DP equals the single-device step, bytes agree three ways, per-worker state."""

import sys
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm import comm, data, models, sync, train

W = 8


@pytest.fixture(scope="module")
def digits_task():
  model = models.MLP(hidden=(32,), num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  batch = data.digits().batch(0, 64)
  return model, params, loss, batch


@pytest.mark.parametrize("inner", [optax.sgd(0.5), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_dp_step_equals_full_batch_step(mesh8, digits_task, inner):
  _, params, loss, batch = digits_task
  trainer = train.Trainer(loss, optax.chain(sync.mean("data"), inner), mesh8)
  state = trainer.init(params)
  for _ in range(2):
    state, _ = trainer.step(state, batch)
  # Reference: the same optimiser on one device with the full batch.
  ref_params, ref_opt = params, inner.init(params)
  for _ in range(2):
    g = jax.grad(loss)(ref_params, batch)
    u, ref_opt = inner.update(g, ref_opt, ref_params)
    ref_params = optax.apply_updates(ref_params, u)
  chex.assert_trees_all_close(state.params, ref_params, atol=1e-6, rtol=1e-5)
  assert int(state.step) == 2


@pytest.mark.parametrize("dtype,itemsize", [(None, 4), (jnp.bfloat16, 2)])
def test_dp_bytes_counted_equal_inspect_and_formula(mesh8, digits_task, dtype, itemsize):
  _, params, loss, batch = digits_task
  trainer = train.Trainer(loss, optax.chain(sync.mean("data", dtype=dtype), optax.sgd(0.1)),
                          mesh8)
  state = trainer.init(params)
  n = sum(x.size for x in jax.tree.leaves(params))
  if dtype is not None:  # One flat buffer, zero-padded to a multiple of W, two-phase.
    n += -n % W
  formula = 2 * (W - 1) / W * n * itemsize
  _, m = trainer.step(state, batch)
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  assert int(m["wire_bytes"]) == formula == report.wire_bytes()
  assert {c.axes for c in report} == {("data",)}
  if dtype is not None:
    assert sorted(c.op for c in report) == ["all-gather", "all-to-all"]
  # bf16 travels as its bits
  assert {c.dtype for c in report} == {"f32" if itemsize == 4 else "u16"}


class LocalSumState(NamedTuple):
  local_sum: optax.Updates  # per-worker running sum of the local gradient
  wire_bytes: jax.Array


def local_sum_then_mean(axis_name):
  """A toy transform with a per-worker buffer: what error memories look like to the builder."""

  def init_fn(params):
    return LocalSumState(jax.tree.map(jnp.zeros_like, params), comm.zero_bytes())

  def update_fn(updates, state, params=None):
    del params
    local = jax.tree.map(jnp.add, state.local_sum, updates)
    mean, nbytes = comm.mean(updates, axis_name)
    return mean, LocalSumState(local, comm.add_bytes(state.wire_bytes, nbytes))

  return optax.GradientTransformation(init_fn, update_fn)


def test_per_worker_state_is_kept_distinct(mesh8, digits_task):
  _, params, loss, _ = digits_task
  trainer = train.Trainer(loss, optax.chain(local_sum_then_mean("data"), optax.adam(1e-2)),
                          mesh8)
  state = trainer.init(params)
  layout = trainer.layout
  assert all(jax.tree.leaves(layout.opt_state[0].local_sum))
  assert not any(jax.tree.leaves(layout.params))
  assert not layout.opt_state[0].wire_bytes
  ds = data.digits()
  for t in range(3):
    state, _ = trainer.step(state, ds.batch(t, 64))
  local = state.opt_state[0].local_sum
  kernel = np.asarray(local["params"]["Dense_0"]["kernel"])
  assert kernel.shape[0] == W
  # Every worker saw different data, so every worker's buffer differs.
  for i in range(W):
    for j in range(i + 1, W):
      assert not np.allclose(kernel[i], kernel[j])
  # Their mean equals the sum of the exact mean gradients, the reference for no silent loss.
  ref, p = jax.tree.map(jnp.zeros_like, params), params
  tx = optax.adam(1e-2)
  opt = tx.init(params)
  for t in range(3):
    g = jax.grad(loss)(p, ds.batch(t, 64))
    ref = jax.tree.map(jnp.add, ref, g)
    u, opt = tx.update(g, opt, p)
    p = optax.apply_updates(p, u)
  chex.assert_trees_all_close(jax.tree.map(lambda x: x.mean(0), local), ref, atol=1e-5)
  # Replicated leaves are stored once, identical everywhere.
  chex.assert_trees_all_close(state.params, p, atol=1e-5)


@pytest.mark.slow
def test_lm_loss_falls_on_embedded_corpus(mesh8):
  lm = models.TransformerLM(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=32)
  params = lm.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32))
  trainer = train.Trainer(models.lm_loss(lm), optax.chain(sync.mean("data"), optax.adam(1e-2)),
                          mesh8)
  ds = data.pydoc_text()
  state, history = train.fit(trainer, trainer.init(params),
                             lambda t: ds.batch(t, 32, seq_len=32), 40, log_every=1,
                             progress=False)
  first, last = history[0]["loss"], np.mean([h["loss"] for h in history[-5:]])
  # Below the unigram entropy of the bytes it saw: it learned more than their frequencies.
  seen = np.concatenate([ds.batch(t, 32, seq_len=32)["tokens"][:, 1:].ravel()
                         for t in range(40)])
  freq = np.bincount(seen, minlength=256) / seen.size
  unigram = -np.sum(freq[freq > 0] * np.log(freq[freq > 0]))
  assert first > 5.0 and last < unigram, (first, last, unigram)
  assert history[-1]["total_wire_bytes"] == 40 * history[-1]["wire_bytes"]


def test_fit_writes_metrics(mesh8, digits_task, tmp_path):
  _, params, loss, _ = digits_task
  trainer = train.Trainer(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh8)
  ds = data.digits()
  _, history = train.fit(trainer, trainer.init(params), lambda t: ds.batch(t, 16), 4,
                         workdir=str(tmp_path), log_every=2, progress=False)
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 2 == len(history)
  assert '"wire_bytes"' in lines[0]


def test_bad_input_fails_before_compile(mesh8, digits_task):
  _, params, loss, batch = digits_task
  with pytest.raises(ValueError, match="batch_axes"):
    train.Trainer(loss, optax.sgd(0.1), mesh8, batch_axes="model")
  trainer = train.Trainer(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh8)
  state = trainer.init(params)
  with pytest.raises(ValueError, match="divisible by the data axis"):
    trainer.step(state, jax.tree.map(lambda x: x[:12], batch))
  with pytest.raises(ValueError, match="dataset"):
    data.load("imagenet")
  with pytest.raises(ValueError, match="multiply"):
    train.make_mesh({"data": 3})
  with pytest.raises(ValueError, match="dtype"):
    sync.mean("data", dtype=jnp.int8)


def test_fit_writes_tensorboard_events_with_each_log_step(mesh8, digits_task, tmp_path):
  """Event files read back with TensorBoard's reader: the loss and byte counts at every log
  step, the simulated clock, the consensus distance of DiLoCo's workers, the bytes table."""
  from tensorboard.backend.event_processing import event_accumulator
  from jaxcomm import local
  _, params, loss, _ = digits_task
  trainer = train.Trainer(loss, local.diloco(optax.adam(1e-2), optax.sgd(0.7), 4,
                                             axis_name="data"), mesh8)
  ds = data.digits()
  seconds = lambda nbytes: 0.01 + nbytes / 1e6  # 10 ms of compute, a 1 MB/s link
  state, history = train.fit(trainer, trainer.init(params), lambda t: ds.batch(t, 16), 6,
                             workdir=str(tmp_path), log_every=3, progress=False,
                             sim_step_seconds=seconds)
  events = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"scalars": 0,
                                                                            "tensors": 0})
  events.Reload()
  scalars = lambda tag: [(e.step, e.value) for e in events.Scalars(tag)]
  assert scalars("loss") == [(h["step"], pytest.approx(h["loss"])) for h in history]
  assert [h["step"] for h in history] == [3, 6]
  sync_bytes = history[0]["total_wire_bytes"]  # steps 1-3 send nothing, step 4 syncs
  assert sync_bytes == 0 and history[1]["total_wire_bytes"] > 0
  assert scalars("total_wire_bytes") == [(3, 0), (6, history[1]["total_wire_bytes"])]
  assert scalars("wire_bytes") == [(3, 0), (6, 0)]  # bytes of the logged step itself
  step_bytes = [0, 0, 0, history[1]["total_wire_bytes"], 0, 0]
  assert history[1]["sim_seconds"] == pytest.approx(sum(map(seconds, step_bytes)))
  assert scalars("sim_seconds")[-1][1] == pytest.approx(history[1]["sim_seconds"])
  # Workers differ two steps after the sync of step 4: the distance of the final state.
  assert history[1]["consensus_distance"] == pytest.approx(
      sync.stacked_consensus_distance(state.params), rel=1e-4)
  assert history[1]["consensus_distance"] > 0
  table, = events.Tensors("wire_bytes_per_axis/text_summary")
  assert "| data | 1 |" in table.tensor_proto.string_val[0].decode()
  assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


def test_fit_reads_the_devices_only_at_log_steps(mesh8, digits_task, monkeypatch):
  _, params, loss, _ = digits_task
  trainer = train.Trainer(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh8)
  ds = data.digits()
  state = trainer.init(params)
  reads, step = [], [0]
  device_get, measure = jax.device_get, trainer.measure
  monkeypatch.setattr(jax, "device_get", lambda x: reads.append(step[0]) or device_get(x))
  monkeypatch.setattr(trainer, "measure", lambda *a: reads.append(step[0]) or measure(*a))

  def batch_fn(t):
    step[0] = t
    return ds.batch(t, 16)

  _, history = train.fit(trainer, state, batch_fn, 7, log_every=3, progress=False)
  assert [h["step"] for h in history] == [3, 6, 7]
  assert sorted(set(reads)) == [2, 5, 6]  # the steps whose results are logged (0-based)


def test_progress_bar_only_on_a_terminal(monkeypatch):
  from jaxcomm.train import _metrics
  assert _metrics.progress_bar(10, 0, True).disable  # pytest's stderr is not a terminal
  monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
  assert not _metrics.progress_bar(10, 0, True).disable
  assert _metrics.progress_bar(10, 0, False).disable


def test_a_batch_axis_no_collective_crosses_is_refused_and_a_users_own_axis_works():
  """The batch split over ("data", "mine") with a transform that syncs over "data" only
  trains copies along "mine" that are never averaged: refused when the step is built,
  naming "mine". The same user axis synchronised by the transform (every step, or every
  H steps inside a lax.cond) trains, and the exact mean over both axes is the full-batch
  gradient step."""
  from jaxcomm import local, parallel
  mesh = parallel.make_mesh({"data": 4, "mine": 2})
  loss = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
  batch = {"x": jnp.arange(16.0) / 16, "y": 2 * jnp.ones(16)}
  axes = ("data", "mine")
  unreduced = train.Trainer(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh,
                            batch_axes=axes)
  with pytest.raises(ValueError, match="mesh axis 'mine' .size 2., but no collective"):
    unreduced.step(unreduced.init({"w": jnp.zeros(())}), batch)
  exact = train.Trainer(loss, optax.chain(sync.mean(axes), optax.sgd(0.1)), mesh,
                        batch_axes=axes)
  state, _ = exact.step(exact.init({"w": jnp.zeros(())}), batch)
  full = jax.grad(lambda p: loss(p, batch))({"w": jnp.zeros(())})["w"]
  np.testing.assert_allclose(float(state.params["w"]), -0.1 * float(full), rtol=1e-6)
  every_3 = train.Trainer(loss, local.diloco(optax.sgd(0.1), optax.sgd(0.7), sync_every=3,
                                             axis_name=axes), mesh, batch_axes=axes)
  state, _ = every_3.step(every_3.init({"w": jnp.zeros(())}), batch)
  assert int(state.step) == 1


def test_consensus_distance_is_logged_before_the_sync_and_after(mesh8, digits_task):
  """With a sync every 3 steps logged every 3 steps, the distance after the logged step is
  ~0 (its sync averaged the workers) and `consensus_distance_before` is that of the
  parameters the logged step started from: those of a run of 2 steps (then 5)."""
  from jaxcomm import local
  _, params, loss, _ = digits_task
  trainer = train.Trainer(loss, local.local_sgd(optax.sgd(0.5), 3, axis_name="data"), mesh8)
  ds = data.digits()
  state, history = train.fit(trainer, trainer.init(params), lambda t: ds.batch(t, 16), 6,
                             log_every=3, progress=False)
  assert [h["step"] for h in history] == [3, 6]
  for h, steps in zip(history, (2, 5)):
    assert h["consensus_distance"] < 1e-6
    partial, _ = train.fit(trainer, trainer.init(params), lambda t: ds.batch(t, 16), steps,
                           log_every=steps, progress=False)
    expected = sync.stacked_consensus_distance(partial.params)
    assert expected > 1e-3 and h["consensus_distance_before"] == pytest.approx(expected,
                                                                                rel=1e-4)
  del state
