"""The pure step is the spine: `make_init` / `make_step` called directly and the `Trainer`
(a convenience over the `Program` record) train alike, bit for bit.

For a linen and an NNX model, with and without per-worker state, two steps are taken two
ways from the same parameters and batches: through the `Trainer`, and through
`derive_layout`, `make_init` and `make_step` called directly (for NNX on the program's
config, which carries the model's parts). The train states, the measurements and the bytes
must be equal bit for bit; `make_program` derives the same layout.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxcomm import local, models, sync, train

W, B, D, C = 8, 16, 8, 4  # workers, global batch, features, classes
STEPS = 2


def _batches():
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(B, D)).astype(np.float32),
           "y": rng.integers(0, C, B).astype(np.int32)} for _ in range(STEPS)]


def _case(kind, per_worker):
  """(loss, transform, a fresh copy of the initial params or NNX model, has_aux)."""
  # Local SGD syncing every 3rd step: after 2 steps the workers still differ.
  tx = (local.local_sgd(optax.sgd(0.1, momentum=0.9), 3, axis_name="data") if per_worker
        else optax.chain(sync.mean("data"), optax.adam(1e-2)))
  if kind == "linen":
    model = models.MLP(hidden=(8,), num_classes=C)
    params = model.init(jax.random.key(0), jnp.zeros((1, D)))
    return models.classifier_loss(model), tx, lambda: params
  # NNX: dropout (RNG streams, replicated) and, with per-worker state, BatchNorm statistics
  # kept per worker as well.
  return models.nnx_classifier_loss, tx, lambda: models.NnxMLP(
      D, hidden=(8,), num_classes=C, dropout=0.1, batch_norm=per_worker,
      rngs=nnx.Rngs(params=0, dropout=1))


def _assert_bitwise(a, b):
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
@pytest.mark.parametrize("per_worker", [False, True], ids=["replicated", "per_worker"])
def test_pure_step_and_trainer_train_alike_bit_for_bit(mesh8, kind, per_worker):
  loss, tx, fresh = _case(kind, per_worker)
  batches = _batches()

  trainer = train.Trainer(loss, tx, mesh8, has_aux=True)
  state = trainer.init(fresh())
  by_trainer = []
  for batch in batches:
    state, m = trainer.step(state, batch)
    by_trainer.append(m)
  program = trainer.program  # the record the Trainer ran
  with pytest.raises(dataclasses.FrozenInstanceError):
    program.step = None
  assert train.make_program(loss, tx, mesh8, fresh(), has_aux=True).layout == program.layout

  if kind == "linen":  # the pure functions from scratch
    config = train.StepConfig(loss, tx, mesh8, has_aux=True)
    layout = train.derive_layout(config, fresh())
    assert layout == program.layout
    pure = train.make_init(config, layout)(fresh(), None)
  else:  # the model's parts travel in the program's config
    config, layout = program.config, program.layout
    _, params, rest = nnx.split(fresh(), nnx.Param, ...)
    pure = train.make_init(config, layout)(nnx.to_pure_dict(params), nnx.to_pure_dict(rest))
  step = train.make_step(config, layout)  # called directly, nothing around it
  for batch, m in zip(batches, by_trainer):
    pure, per_device, sent = step(pure, batch)
    _assert_bitwise(program.measure(per_device, sent), m)
  _assert_bitwise(pure, state)

  # With per-worker state the workers differ; replicated, every worker's view is the same.
  assert any(jax.tree.leaves((layout.params, layout.opt_state, layout.model_state))) == \
      per_worker
  first, last = (program.worker_view(state.params, layout.params, w) for w in (0, W - 1))
  assert per_worker == any(np.any(np.asarray(a) != np.asarray(b))
                           for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(last)))
  if kind == "nnx":
    _assert_bitwise(nnx.state(program.model(pure, W - 1)),
                    nnx.state(trainer.model(state, W - 1)))


def test_make_step_traces_the_loss_once_and_checks_that_trace(mesh8):
  """The step is traced at its first use (lowering), once: the calls reuse that trace. A
  batch axis no collective crosses is refused as the trace is made."""
  traces = []

  def loss(p, b):
    traces.append(1)  # a Python side effect: runs once per trace
    return jnp.mean((b["x"] * p["w"]) ** 2)

  params, batch = {"w": jnp.ones(())}, {"x": jnp.arange(16.0)}
  config = train.StepConfig(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh8)
  layout = train.derive_layout(config, params)
  step = train.make_step(config, layout)
  state = train.make_init(config, layout)(params, None)
  assert not traces  # built without tracing
  step.lower(state, batch)
  for _ in range(2):
    state, _, _ = step(state, batch)
  assert len(traces) == 1 and int(state.step) == 2

  unsynced = train.StepConfig(loss, optax.sgd(0.1), mesh8)
  layout = train.derive_layout(unsynced, params)
  step = train.make_step(unsynced, layout)
  with pytest.raises(ValueError, match="mesh axis 'data' .size 8., but no collective"):
    step(train.make_init(unsynced, layout)(params, None), batch)
  with pytest.raises(ValueError, match="program must be a jaxcomm.train.Program"):
    train.fit(step, state, lambda t: batch, 1)


def test_a_batch_is_placed_before_any_parameters_are_seen():
  # A loop may shard its first batch before `init` (tests/grain_runner.py does): the batch's
  # placement needs only the mesh and the batch axes, not the program.
  mesh = train.make_mesh({"data": W})
  trainer = train.Trainer(lambda p, b: 0.0, sync.mean("data"), mesh)
  batch = _batches()[0]
  placed = trainer.shard_batch(batch)
  for name, x in placed.items():
    np.testing.assert_array_equal(np.asarray(x), batch[name])
    assert x.sharding.spec == jax.sharding.PartitionSpec("data")
  assert trainer.batch_spec(batch) == {"x": jax.sharding.PartitionSpec("data"),
                                       "y": jax.sharding.PartitionSpec("data")}
