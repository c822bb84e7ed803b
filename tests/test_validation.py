"""Property: every public factory, fed arbitrary argument values, either builds something
that works or raises ValueError naming a bad argument, never another exception; and it
never rejects a valid configuration.

Every argument is drawn either from its valid values or from junk (None, bools, negative
and huge numbers, NaN, empty and odd strings, tuples, callables), and the draw remembers
which (`Drawn`). `builds_or_value_error` then holds the factory to both directions: a draw
whose arguments all came from their valid values (and every `@example`) must build and
pass the check; otherwise a ValueError is allowed, but its message must name one of the
arguments drawn from junk (junk that happens to be valid may also build). "Works" is
checked cheaply for each factory: a transform runs one update (on a mesh with the axis
names it was given), a mesh has the requested shape, a dataset returns a batch, a codec
round-trips.
"""

import os
import re
import string
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, data, sync, train

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


class Drawn(NamedTuple):
  """An argument value and whether it was drawn from the argument's valid values."""
  value: Any
  valid: bool


def ok(value) -> Drawn:
  """A value the factory must accept (for `@example` rows)."""
  return Drawn(value, True)


def junk(value) -> Drawn:
  """A value the factory may reject (with a ValueError naming the argument)."""
  return Drawn(value, False)


NAMES = st.text(alphabet=string.ascii_letters + "_- .", max_size=4)
NONEMPTY = st.text(alphabet=string.ascii_letters + "_- .", min_size=1, max_size=4)
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 10),
                 st.floats(allow_nan=True, allow_infinity=True), NAMES,
                 st.just(()), st.lists(st.integers(0, 3), max_size=2), st.just(print))
# Huge integers where a valid huge value costs nothing (not sizes of things to allocate).
JUNK_OR_HUGE = st.one_of(JUNK, st.integers(2**40, 2**41))


def valid_or(valid, bad=JUNK):
  """Values from `valid` (must be accepted) or from `bad` (may be rejected), tagged with where
  they came from. About one argument in four is junk, so that draws whose arguments are all
  valid (which must build) are common even for factories of six arguments."""
  return st.sampled_from([False, False, False, True]).flatmap(
      lambda is_junk: bad.map(junk) if is_junk else valid.map(ok))


VALID_AXIS_NAMES = st.one_of(st.sampled_from([None, "data"]), NONEMPTY,
                             st.lists(NONEMPTY, min_size=1, max_size=3, unique=True).map(tuple))
AXIS_NAMES = valid_or(VALID_AXIS_NAMES, st.one_of(st.lists(NAMES, max_size=3).map(tuple), JUNK))
FLOAT_DTYPES = ["bfloat16", "float32", "float16", "float8_e4m3fn", "float8_e5m2", jnp.bfloat16,
                jnp.float32, np.float16]
BAD_DTYPES = st.one_of(st.sampled_from(["int8", "uint32", "bool", "complex64", jnp.int32,
                                        "bf16", ""]), JUNK)
DTYPES = valid_or(st.sampled_from([None] + FLOAT_DTYPES), BAD_DTYPES)
VALID_TRANSFORMS = st.sampled_from([optax.sgd(0.1), optax.adam(0.01), sync.mean(None)])
TRANSFORMS = valid_or(VALID_TRANSFORMS, st.one_of(st.just("adam"), JUNK))
SMALL = st.integers(1, 4)


def _names(message: str, name: str) -> bool:
  return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message) is not None


def builds_or_value_error(factory, check=None, *, joint=None, **args: Drawn):
  """The property: `factory(**values)` builds something `check` accepts, or raises a
  ValueError whose message names an argument that may be bad.

  Args:
    factory: called with the drawn values as keyword arguments.
    check: `check(built)` asserts that what was built works; it may raise ValueError for
      checks made only when the object meets the mesh or the parameters (deferred checks).
    joint: `joint(values) -> names`: arguments whose combination is invalid although each
      value alone is valid (e.g. more fragments than steps); () when the combination is fine.
    **args: every argument as a `Drawn`.

  Raises:
    AssertionError: a valid configuration was rejected, or a ValueError names no argument
      that may be bad.
  """
  values = {name: d.value for name, d in args.items()}
  suspects = [name for name, d in args.items() if not d.valid]
  suspects += [name for name in (joint(values) if joint else ()) if name not in suspects]
  try:
    built = factory(**values)
    if check is not None:
      check(built)
  except ValueError as e:
    if not suspects:
      raise AssertionError(f"a valid configuration was rejected: {values}: {e}") from e
    if not any(_names(str(e), name) for name in suspects):
      raise AssertionError(f"the ValueError names none of the suspect arguments "
                           f"{suspects}: {e}") from e
    _event("ValueError")
    return
  _event("built (all valid)" if not suspects else "built")


def _event(text: str) -> None:
  if currently_in_test_context():  # hypothesis' statistics (also callable from plain tests)
    event(text)


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
  # On the host: an eager isfinite on a sharded array compiles two small programs per mesh.
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(out))


# ------------------------------------------------------------------ the property itself
def test_the_property_catches_a_wrongly_rejected_valid_configuration():
  """What the property adds over "builds or raises ValueError": a factory that rejects a
  valid value, or whose error blames an argument that is fine, fails it."""
  def picky_mean(axis_name, dtype):  # rejects bf16, a valid wire dtype of sync.mean
    if dtype == "bfloat16":
      raise ValueError(f"dtype must be float32, got {dtype!r}.")
    return sync.mean(axis_name, dtype=dtype)

  check = lambda tx: run_update(tx, "data")
  builds_or_value_error(picky_mean, check, axis_name=ok("data"), dtype=ok("float32"))
  with pytest.raises(AssertionError, match="valid configuration was rejected"):
    builds_or_value_error(picky_mean, check, axis_name=ok("data"), dtype=ok("bfloat16"))
  # A junk value may be rejected by an error that names it ...
  builds_or_value_error(sync.mean, check, axis_name=ok("data"), dtype=junk("int8"))
  # ... but not by one that blames another argument.
  blames_axis = lambda axis_name, dtype: sync.mean(3, dtype=dtype)
  with pytest.raises(AssertionError, match="names none"):
    builds_or_value_error(blames_axis, check, axis_name=ok("data"), dtype=junk("int8"))


# ------------------------------------------------------------------ sync
@SETTINGS
@given(axis_name=AXIS_NAMES, dtype=DTYPES)
@example(axis_name=ok("data"), dtype=ok(None))
@example(axis_name=ok(("a", "b")), dtype=ok("bfloat16"))
@example(axis_name=ok(None), dtype=ok(np.float16))
def test_sync_mean(axis_name, dtype):
  builds_or_value_error(lambda axis_name, dtype: sync.mean(axis_name, dtype=dtype),
                        lambda tx: run_update(tx, axis_name.value),
                        axis_name=axis_name, dtype=dtype)


@SETTINGS
@given(inner=TRANSFORMS, axis_name=AXIS_NAMES)
@example(inner=ok(optax.sgd(0.1)), axis_name=ok("data"))
@example(inner=ok(sync.mean(None)), axis_name=ok(("x", "y", "z")))
def test_sync_skip_nonfinite(inner, axis_name):
  builds_or_value_error(sync.skip_nonfinite, lambda tx: run_update(tx, axis_name.value),
                        inner=inner, axis_name=axis_name)


# ------------------------------------------------------------------ train
SIZES = st.one_of(st.integers(-1, 9), st.sampled_from([2.0, 8.0, True, "8", None]))
# Sizes that multiply to the 8 devices, under random axis names.
VALID_MESH = st.sampled_from([(8,), (4, 2), (2, 4), (2, 2, 2), (1, 8)]).flatmap(
    lambda sizes: st.lists(NONEMPTY, min_size=len(sizes), max_size=len(sizes),
                           unique=True).map(
        lambda names: dict(zip(names, sizes))))


@SETTINGS
@given(shape=valid_or(VALID_MESH, st.one_of(st.dictionaries(NAMES, SIZES, max_size=3),
                                            st.lists(SIZES, min_size=1, max_size=3), JUNK)),
       axis_names=valid_or(st.none(), st.one_of(st.lists(NAMES, min_size=1, max_size=3),
                                                JUNK)))
@example(shape=ok({"data": 4, "tensor": 2}), axis_names=ok(None))
@example(shape=junk([2, 2, 2]), axis_names=junk(["a", "b", "c"]))  # sizes + names: valid
def test_train_make_mesh(shape, axis_names):
  def check(mesh):
    assert mesh.devices.size == jax.device_count()
    s, names = shape.value, axis_names.value
    assert dict(mesh.shape) == (s if isinstance(s, dict) else dict(zip(names, s)))
  builds_or_value_error(train.make_mesh, check, shape=shape, axis_names=axis_names)


def _loss(p, b):
  return jnp.sum((p["w"] * b["x"]) ** 2)


@SETTINGS
@given(batch_axes=valid_or(st.just("data"), st.one_of(VALID_AXIS_NAMES, JUNK)),
       optimizer=valid_or(st.just(optax.chain(sync.mean("data"), optax.sgd(0.1))),
                          st.one_of(VALID_TRANSFORMS, st.just("adam"), JUNK)),
       loss_fn=valid_or(st.just(_loss), st.sampled_from([None, "loss"])))
@example(batch_axes=ok("data"), optimizer=ok(optax.chain(sync.mean("data"), optax.sgd(0.1))),
         loss_fn=ok(_loss))
def test_train_trainer(mesh8, batch_axes, optimizer, loss_fn):
  def check(trainer):
    state = trainer.init({"w": jnp.ones(2)})
    assert int(state.step) == 0
  builds_or_value_error(
      lambda loss_fn, optimizer, batch_axes: train.Trainer(loss_fn, optimizer, mesh8,
                                                           batch_axes=batch_axes),
      check, loss_fn=loss_fn, optimizer=optimizer, batch_axes=batch_axes)


@SETTINGS
@given(steps=valid_or(st.integers(0, 2)), log_every=valid_or(SMALL, JUNK_OR_HUGE))
@example(steps=ok(2), log_every=ok(1))
def test_train_fit(mesh8, steps, log_every):
  trainer = _tiny_trainer(mesh8)
  batch_fn = lambda t: {"x": np.ones((8, 2), np.float32)}
  if isinstance(steps.value, int) and not isinstance(steps.value, bool) and steps.value > 2:
    steps = Drawn(2, steps.valid)  # keep junk that happens to be valid short

  def check(out):
    state, history = out
    assert int(state.step) == steps.value and len(history) <= steps.value

  builds_or_value_error(
      lambda steps, log_every: train.fit(trainer, trainer.init({"w": jnp.ones(2)}), batch_fn,
                                         steps, log_every=log_every, progress=False),
      check, steps=steps, log_every=log_every)


_TRAINERS = {}


def _tiny_trainer(mesh):
  if "t" not in _TRAINERS:
    _TRAINERS["t"] = train.Trainer(_loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh)
  return _TRAINERS["t"]


@SETTINGS
@given(directory=valid_or(st.sampled_from(["ckpt", "nested/ckpt"])),
       every=valid_or(SMALL, JUNK_OR_HUGE), keep=valid_or(SMALL, JUNK_OR_HUGE))
@example(directory=ok("ckpt"), every=ok(2), keep=ok(3))
def test_train_checkpointer(tmp_path, directory, every, keep):
  def checkpointer(directory, every, keep):
    path = str(tmp_path / directory) if isinstance(directory, str) and directory else directory
    return train.Checkpointer(path, every=every, keep=keep)

  def check(ckpt):
    assert ckpt.steps == []
    ckpt.close()

  builds_or_value_error(checkpointer, check, directory=directory, every=every, keep=keep)


@SETTINGS
@given(coordinator=valid_or(st.none(), st.one_of(st.sampled_from(
           ["", "host", "host:", ":1234", "host:0", "host:70000", "host:port"]), JUNK)),
       num_processes=valid_or(st.none(), JUNK_OR_HUGE),
       process_id=valid_or(st.none(), JUNK_OR_HUGE),
       heartbeat_timeout_s=valid_or(st.integers(1, 100), JUNK_OR_HUGE))
@example(coordinator=ok(None), num_processes=ok(None), process_id=ok(None),
         heartbeat_timeout_s=ok(30))
def test_train_start_distributed(coordinator, num_processes, process_id, heartbeat_timeout_s):
  # Only invalid coordinators are drawn: a valid one would really try to connect.
  if train.multi_process_environment():
    pytest.skip("runs inside a multi-process job")

  def check(started):
    assert started is False  # no coordinator: nothing to join

  builds_or_value_error(train.start_distributed, check, coordinator=coordinator,
                        num_processes=num_processes, process_id=process_id,
                        heartbeat_timeout_s=heartbeat_timeout_s)


# ------------------------------------------------------------------ data
@SETTINGS
@given(name=valid_or(st.sampled_from(["digits", "pydoc", "text:" + os.path.abspath(__file__)]),
                     st.one_of(st.sampled_from(["text:/no/such/file", "text:", "imagenet",
                                                "DIGITS", "text:<path>"]), JUNK)))
@example(name=ok("digits"))
@example(name=ok("pydoc"))
@example(name=junk("text:/no/such/file"))
def test_data_load(name):
  def check(ds):
    batch = ds.batch(0, 8)
    assert all(len(v) == 8 for v in batch.values())
  builds_or_value_error(data.load, check, name=name)


@SETTINGS
@given(step=valid_or(st.integers(0, 2**31), JUNK_OR_HUGE),
       batch_size=valid_or(st.sampled_from([4, 8, 12, 16])),
       seed=valid_or(st.integers(0, 9), JUNK_OR_HUGE),
       process_index=valid_or(st.integers(0, 3), JUNK_OR_HUGE),
       process_count=valid_or(st.sampled_from([1, 2, 4])),
       seq_len=valid_or(st.integers(1, 64), JUNK_OR_HUGE))
@example(step=ok(3), batch_size=ok(8), seed=ok(0), process_index=ok(1), process_count=ok(2),
         seq_len=ok(16))
def test_data_batch(step, batch_size, seed, process_index, process_count, seq_len):
  def joint(values):  # this process must exist; the batch must split evenly
    index, count = values["process_index"], values["process_count"]
    bad = []
    if isinstance(index, int) and isinstance(count, int) and not 0 <= index < count:
      bad.append("process_index")
    if isinstance(count, int) and count > 0 and isinstance(values["batch_size"], int) and \
       values["batch_size"] % count:
      bad.append("batch_size")
    return bad

  def check(out):
    n = batch_size.value // process_count.value
    assert all(len(v) == n for v in out.values())

  args = dict(step=step, batch_size=batch_size, seed=seed, process_index=process_index,
              process_count=process_count)
  builds_or_value_error(lambda **kw: data.digits().batch(kw.pop("step"), kw.pop("batch_size"),
                                                         **kw), check, joint=joint, **args)
  builds_or_value_error(lambda **kw: data.pydoc_text().batch(kw.pop("step"),
                                                             kw.pop("batch_size"), **kw),
                        check, joint=joint, seq_len=seq_len, **args)


# ------------------------------------------------------------------ codecs
@SETTINGS
@given(dtype=valid_or(st.sampled_from(FLOAT_DTYPES), st.one_of(st.none(), BAD_DTYPES)))
@example(dtype=ok("bfloat16"))
@example(dtype=ok(jnp.float16))
def test_codecs_cast(dtype):
  def check(codec):
    x = jnp.linspace(-1, 1, 8)
    y = codec.roundtrip(x)
    assert y.shape == x.shape and float(jnp.max(jnp.abs(y - x))) <= 0.25
    assert codec.payload_bytes(8) == 8 * jnp.dtype(codec.name[len("cast("):-1]).itemsize
  builds_or_value_error(codecs.cast, check, dtype=dtype)


def test_messages_name_the_argument():
  cases = [
      (lambda: sync.mean("data", dtype="int8"), "dtype"),
      (lambda: sync.mean(axis_name=3), "axis_name"),
      (lambda: sync.skip_nonfinite("adam"), "inner"),
      (lambda: train.make_mesh({"data": 3}), "shape"),
      (lambda: train.make_mesh({"data": 2.5}), "shape"),
      (lambda: train.Checkpointer("x", every=0), "every"),
      (lambda: train.start_distributed("host:1", 2, 5), "process_id"),
      (lambda: data.load(3), "name"),
      (lambda: data.load("text:/no/such/file"), "name"),
      (lambda: data.digits().batch(0, 10, process_count=3), "batch_size"),
      (lambda: codecs.cast(object()), "dtype"),
  ]
  for build, word in cases:
    with pytest.raises(ValueError, match=rf"\b{word}\b"):
      build()
