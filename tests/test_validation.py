"""Property: every public factory, fed arbitrary argument values, either builds something
that works or raises ValueError (naming the argument), never another exception.

Arguments are drawn from a mix of valid values and junk (None, bools, negative and huge
numbers, NaN, empty and odd strings, tuples, callables). "Works" is checked cheaply for each
factory: a transform runs one update (on a mesh with the axis names it was given), a mesh has
the requested shape, a dataset returns a batch, a codec round-trips.
"""

import os
import string

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, data, sync, train

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

NAMES = st.text(alphabet=string.ascii_letters + "_- .", max_size=4)
NONEMPTY = st.text(alphabet=string.ascii_letters + "_- .", min_size=1, max_size=4)
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 10),
                 st.floats(allow_nan=True, allow_infinity=True), NAMES,
                 st.just(()), st.lists(st.integers(0, 3), max_size=2), st.just(print))
# Huge integers where a valid huge value costs nothing (not sizes of things to allocate).
JUNK_OR_HUGE = st.one_of(JUNK, st.integers(2**40, 2**41))


def valid_or(valid, junk=JUNK):
  """Valid values or junk (about half each; hypothesis does not repeat an example, so small
  valid spaces are used up quickly: the @example cases pin the working paths)."""
  return st.one_of(valid, junk)


AXIS_NAMES = valid_or(st.one_of(st.sampled_from([None, "data"]), NONEMPTY,
                              st.lists(NONEMPTY, min_size=1, max_size=3, unique=True).map(tuple)),
                    st.one_of(st.lists(NAMES, max_size=3).map(tuple), JUNK))
DTYPES = valid_or(st.sampled_from([None, "bfloat16", "float32", "float16", "float8_e4m3fn",
                                 "float8_e5m2", jnp.bfloat16, jnp.float32, np.float16]),
                st.one_of(st.sampled_from(["int8", "uint32", "bool", "complex64", jnp.int32,
                                           "bf16", ""]), JUNK))
TRANSFORMS = valid_or(st.sampled_from([optax.sgd(0.1), optax.adam(0.01), sync.mean(None)]),
                    st.one_of(st.just("adam"), JUNK))
SMALL = st.integers(1, 4)


def builds_or_value_error(build, check):
  """`build()` raises ValueError, or returns something `check` accepts without error."""
  try:
    built = build()
  except ValueError:
    event("ValueError")
    return
  event("built")
  check(built)


def mesh_for(axis_name):
  """A mesh over the 8 devices whose axes are `axis_name` (None: no mesh)."""
  if axis_name is None:
    return None
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  sizes = {1: (8,), 2: (4, 2), 3: (2, 2, 2)}[len(names)]
  return train.make_mesh(dict(zip(names, sizes)))


def run_update(tx, axis_name):
  """One update of `tx` on a tiny gradient, inside shard_map over `axis_name`'s mesh.

  The gradient is each worker's own (varying over the axes), as the Trainer passes it.
  """
  params = {"w": jnp.arange(3.0), "b": jnp.ones(())}
  axes = () if axis_name is None else tuple(mesh_for(axis_name).axis_names)

  def update(p):
    grads = jax.tree.map(lambda x: x + 1, comm.varying(p, axes))
    out = tx.update(grads, tx.init(p), p)[0]
    return jax.tree.map(lambda x: comm.varying(x, axes)[None], out)

  mesh = mesh_for(axis_name)
  if mesh is None:
    out = update(params)
  else:
    out = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=P(), out_specs=P(axes)))(params)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))


@SETTINGS
@given(axis_name=AXIS_NAMES, dtype=DTYPES)
@example(axis_name="data", dtype=None)
@example(axis_name=("a", "b"), dtype="bfloat16")
@example(axis_name=None, dtype=np.float16)
def test_sync_mean(axis_name, dtype):
  builds_or_value_error(lambda: sync.mean(axis_name, dtype=dtype),
                        lambda tx: run_update(tx, axis_name))


@SETTINGS
@given(inner=TRANSFORMS, axis_name=AXIS_NAMES)
@example(inner=optax.sgd(0.1), axis_name="data")
@example(inner=sync.mean(None), axis_name=("x", "y", "z"))
def test_sync_skip_nonfinite(inner, axis_name):
  builds_or_value_error(lambda: sync.skip_nonfinite(inner, axis_name),
                        lambda tx: run_update(tx, axis_name))


SIZES = st.one_of(st.integers(-1, 9), st.sampled_from([2.0, 8.0, True, "8", None]))
# Sizes that multiply to the 8 devices, under random axis names.
VALID_MESH = st.sampled_from([(8,), (4, 2), (2, 4), (2, 2, 2), (1, 8)]).flatmap(
    lambda sizes: st.lists(NONEMPTY, min_size=len(sizes), max_size=len(sizes),
                           unique=True).map(
        lambda names: dict(zip(names, sizes))))


@SETTINGS
@given(shape=valid_or(st.one_of(VALID_MESH, st.dictionaries(NAMES, SIZES, max_size=3),
                              st.lists(SIZES, min_size=1, max_size=3))),
       axis_names=valid_or(st.lists(NAMES, min_size=1, max_size=3)))
@example(shape={"data": 4, "tensor": 2}, axis_names=None)
@example(shape=[2, 2, 2], axis_names=["a", "b", "c"])
def test_train_make_mesh(shape, axis_names):
  def check(mesh):
    assert mesh.devices.size == jax.device_count()
    want = shape if isinstance(shape, dict) else dict(zip(axis_names, shape))
    assert dict(mesh.shape) == want
  builds_or_value_error(lambda: train.make_mesh(shape, axis_names), check)


@SETTINGS
@given(axis_name=valid_or(st.just("data"), AXIS_NAMES),
       optimizer=valid_or(st.just(optax.chain(sync.mean("data"), optax.sgd(0.1))), TRANSFORMS),
       loss_fn=valid_or(st.just(lambda p, b: jnp.sum((p["w"] * b["x"]) ** 2)),
                      st.sampled_from([None, "loss"])))
@example(axis_name="data", optimizer=optax.chain(sync.mean("data"), optax.sgd(0.1)),
         loss_fn=lambda p, b: jnp.sum((p["w"] * b["x"]) ** 2))
def test_train_trainer(mesh8, axis_name, optimizer, loss_fn):
  def check(trainer):
    state = trainer.init({"w": jnp.ones(2)})
    assert int(state.step) == 0
  builds_or_value_error(lambda: train.Trainer(loss_fn, optimizer, mesh8, axis_name=axis_name),
                        check)


@SETTINGS
@given(steps=valid_or(st.integers(0, 2)), log_every=valid_or(SMALL, JUNK_OR_HUGE))
@example(steps=2, log_every=1)
def test_train_fit(mesh8, steps, log_every):
  trainer = _tiny_trainer(mesh8)
  batch_fn = lambda t: {"x": np.ones((8, 2), np.float32)}
  steps = min(steps, 2) if isinstance(steps, int) else steps  # keep valid runs short
  builds_or_value_error(
      lambda: train.fit(trainer, trainer.init({"w": jnp.ones(2)}), batch_fn, steps,
                        log_every=log_every, progress=False),
      lambda out: None)


_TRAINERS = {}


def _tiny_trainer(mesh):
  if "t" not in _TRAINERS:
    _TRAINERS["t"] = train.Trainer(lambda p, b: jnp.sum((p["w"] * b["x"]) ** 2),
                                   optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh)
  return _TRAINERS["t"]


@SETTINGS
@given(directory=valid_or(st.sampled_from(["ckpt", "nested/ckpt"])),
       every=valid_or(SMALL, JUNK_OR_HUGE), keep=valid_or(SMALL, JUNK_OR_HUGE))
@example(directory="ckpt", every=2, keep=3)
def test_train_checkpointer(tmp_path, directory, every, keep):
  path = str(tmp_path / directory) if isinstance(directory, str) and directory else directory
  builds_or_value_error(lambda: train.Checkpointer(path, every=every, keep=keep),
                        lambda ckpt: ckpt.steps == [])


@SETTINGS
@given(coordinator=valid_or(st.none(), st.one_of(st.sampled_from(
           ["", "host", "host:", ":1234", "host:0", "host:70000", "host:port"]), JUNK)),
       num_processes=valid_or(st.none(), JUNK_OR_HUGE), process_id=valid_or(st.none(), JUNK_OR_HUGE),
       heartbeat=valid_or(st.integers(1, 100), JUNK_OR_HUGE))
@example(coordinator=None, num_processes=None, process_id=None, heartbeat=30)
def test_train_start_distributed(coordinator, num_processes, process_id, heartbeat):
  # Only invalid coordinators are drawn: a valid one would really try to connect.
  if train.multi_process_environment():
    pytest.skip("runs inside a multi-process job")
  builds_or_value_error(
      lambda: train.start_distributed(coordinator, num_processes, process_id,
                                      heartbeat_timeout_s=heartbeat),
      lambda started: None if started is False else pytest.fail("started"))


@SETTINGS
@given(name=valid_or(st.sampled_from(["digits", "pydoc", "text:" + os.path.abspath(__file__)]),
                  st.one_of(st.sampled_from(["text:/no/such/file", "text:", "imagenet",
                                             "DIGITS", "text:<path>"]), JUNK)))
@example(name="digits")
@example(name="pydoc")
def test_data_load(name):
  def check(ds):
    batch = ds.batch(0, 8)
    assert all(len(v) == 8 for v in batch.values())
  builds_or_value_error(lambda: data.load(name), check)


@SETTINGS
@given(step=valid_or(st.integers(0, 2**31), JUNK_OR_HUGE),
       batch_size=valid_or(st.sampled_from([4, 8, 12, 16])),
       seed=valid_or(st.integers(0, 9), JUNK_OR_HUGE),
       process_index=valid_or(st.integers(0, 3), JUNK_OR_HUGE),
       process_count=valid_or(st.sampled_from([1, 2, 4])),
       seq_len=valid_or(st.integers(1, 64), JUNK_OR_HUGE))
@example(step=3, batch_size=8, seed=0, process_index=1, process_count=2, seq_len=16)
def test_data_batch(step, batch_size, seed, process_index, process_count, seq_len):
  def batch(ds, **kw):
    return lambda: ds.batch(step, batch_size, seed=seed, process_index=process_index,
                            process_count=process_count, **kw)

  def check(out):
    n = batch_size // process_count
    assert all(len(v) == n for v in out.values())

  builds_or_value_error(batch(data.digits()), check)
  builds_or_value_error(batch(data.pydoc_text(), seq_len=seq_len), check)


@SETTINGS
@given(dtype=DTYPES)
@example(dtype="bfloat16")
@example(dtype=jnp.float16)
def test_codecs_cast(dtype):
  def check(codec):
    x = jnp.linspace(-1, 1, 8)
    y = codec.roundtrip(x)
    assert y.shape == x.shape and float(jnp.max(jnp.abs(y - x))) <= 0.25
    assert codec.payload_bytes(8) == 8 * jnp.dtype(codec.name[len("cast("):-1]).itemsize
  builds_or_value_error(lambda: codecs.cast(dtype), check)


def test_messages_name_the_argument():
  cases = [
      (lambda: sync.mean("data", dtype="int8"), "dtype"),
      (lambda: sync.mean(axis_name=3), "axis_name"),
      (lambda: sync.skip_nonfinite("adam"), "inner"),
      (lambda: train.make_mesh({"data": 3}), "multiply"),
      (lambda: train.make_mesh({"data": 2.5}), "mesh axis sizes"),
      (lambda: train.Checkpointer("x", every=0), "every"),
      (lambda: train.start_distributed("host:1", 2, 5), "process_id"),
      (lambda: data.load(3), "dataset"),
      (lambda: data.digits().batch(0, 10, process_count=3), "divisible"),
      (lambda: codecs.cast(object()), "cast dtype"),
  ]
  for build, word in cases:
    with pytest.raises(ValueError, match=word):
      build()
