"""The contract every jaxcomm transform and codec passes (import these from your tests).

Transforms (optax `GradientTransformation`s, usually a full chain ending in an optimiser):

* `check_transform(tx)` runs all one-device checks, sharing compiled functions:
  `jit` without recompiling on the second call, bf16 and f32 parameters keep their dtype,
  state structure / shapes / dtypes unchanged by `update`, `init` traced on
  `jax.ShapeDtypeStruct`s gives the same state shapes, and convergence on a quadratic inside
  `lax.scan`. Build the transform with `axis_name=None` for these.
* `check_on_mesh(tx, mesh)` runs the transform in the `Trainer` on a mesh: the step compiles
  once, state structure is unchanged, and the bytes measured by the step equal
  `comm.inspect`'s reading of the compiled step. Returns the measurements for further checks.

Codecs: `check_codec(codec, x, key)` checks payload bytes against the traced payload, packed
narrow wire dtypes, and the stated error bound. `codec_zoo()` is one instance of every codec,
sized for small test vectors.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import codecs, comm, data, models, train


def codec_zoo() -> dict:
  """One instance of every codec (with blocks small enough to matter on ~1000 elements)."""
  zoo = [
      codecs.identity(), codecs.cast("float32"), codecs.cast("bfloat16"),
      codecs.cast("float8_e4m3fn"),
      codecs.uniform(4, block=64, symmetric=False), codecs.uniform(3, stochastic=True, block=100),
      codecs.qsgd(7, bucket=128), codecs.sign(block=128),
      codecs.top_k(0.05), codecs.top_k(k=4, chunk=64),
      codecs.random_k(0.1), codecs.random_k(0.1, shared_key=False), codecs.rtop_k(0.2, 0.05),
      codecs.dct_top_k(64, 8), codecs.log_quant(5, 10.0, block=256), codecs.fp4(),
      codecs.fp4(stochastic=True), codecs.fp8(block=128), codecs.fp8("e5m2"),
  ]
  return {c.name: c for c in zoo}


# ---------------------------------------------------------------------------- transforms
def example_params(dtype=jnp.float32):
  """The small parameter tree (two leaves, 16 elements) every contract check uses."""
  return {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4).astype(dtype),
          "b": jnp.linspace(0.5, -0.5, 4, dtype=jnp.float32).astype(dtype)}


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _same_types(a, b, what):
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert (jnp.shape(x), jnp.result_type(x)) == (jnp.shape(y), jnp.result_type(y)), \
        f"{what}: {jnp.shape(x)} {jnp.result_type(x)} became {jnp.shape(y)} {jnp.result_type(y)}"


def check_jit_state_and_dtypes(tx: optax.GradientTransformation) -> None:
  """jit without recompiling, dtypes kept (f32 and bf16), state unchanged, init abstract.

  The second call must hit the compilation cache; dtypes and state types are static, so the
  bf16 checks read them from `jax.eval_shape` instead of compiling a second program.
  """
  params = example_params(jnp.float32)
  grads = jax.tree.map(lambda p: 0.3 * p + 0.1, params)
  state = tx.init(params)
  update = jax.jit(tx.update)
  updates, new_state = update(grads, state, params)
  compiled = update._cache_size()  # pylint: disable=protected-access  (jit caches per function)
  updates, new_state = update(grads, new_state, params)
  recompiled = update._cache_size() != compiled  # pylint: disable=protected-access
  assert not recompiled, "update recompiled on the second call"
  _same_types(state, new_state, "state after update")
  chex.assert_tree_all_finite(updates)
  for dtype in (jnp.float32, jnp.bfloat16):
    abstract = _abstract(example_params(dtype))
    state_abs = jax.eval_shape(tx.init, abstract)
    _same_types(state_abs, tx.init(example_params(dtype)), "init on ShapeDtypeStruct")
    updates_abs, new_state_abs = jax.eval_shape(tx.update, abstract, state_abs, abstract)
    _same_types(abstract, updates_abs, f"updates of {jnp.dtype(dtype).name} parameters")
    _same_types(state_abs, new_state_abs, "state after update")


def check_converges_on_quadratic(tx: optax.GradientTransformation, steps: int = 200,
                                 factor: float = 1e-2) -> float:
  """Minimises 0.5 ||p - target||^2 inside lax.scan; final loss < factor * initial."""
  params = example_params(jnp.float32)
  target = jax.tree.map(lambda p: 1.0 + 0.5 * jnp.sin(3.0 * p), params)
  loss = lambda p: 0.5 * sum(jnp.sum((a - b) ** 2) for a, b in
                             zip(jax.tree.leaves(p), jax.tree.leaves(target)))

  @jax.jit
  def run(params):
    def body(carry, _):
      p, s = carry
      u, s = tx.update(jax.grad(loss)(p), s, p)
      return (optax.apply_updates(p, u), s), None
    (p, _), _ = lax.scan(body, (params, tx.init(params)), None, length=steps)
    return loss(p)

  final, initial = float(run(params)), float(loss(params))
  assert final < factor * initial, f"did not converge: loss {initial:.4g} -> {final:.4g}"
  return final


def check_transform(tx: optax.GradientTransformation, steps: int = 200,
                    factor: float = 1e-2) -> None:
  """Every one-device contract check (build `tx` with axis_name=None)."""
  check_jit_state_and_dtypes(tx)
  check_converges_on_quadratic(tx, steps, factor)


def check_on_mesh(tx: optax.GradientTransformation, mesh, axis_name="data", steps: int = 2):
  """The transform in the Trainer: compiles once, state types kept, bytes == inspect.

  Each worker minimises 0.5 ||p - t_w||^2 with its own target t_w. Returns
  `(trainer, state, measurements, report)`: the last step's state and measurements and the
  `comm.inspect` report of the compiled step. `comm.inspect` turns operand bytes into wire
  bytes with the same per-op helpers as the counters, so bytes == inspect proves operand
  shapes and trip counts; the caller holds the bytes against a literal or formula of its own
  (docs/algorithms.md), and tests/test_comm.py pins the helpers themselves.
  """
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  w = math.prod(mesh.shape[a] for a in axes)
  params = example_params(jnp.float32)
  loss = lambda p, b: 0.5 * sum(jnp.sum((x - b["t"][0, i]) ** 2)
                                for i, x in enumerate(jax.tree.leaves(p)))
  batch = {"t": jnp.arange(w * 2, dtype=jnp.float32).reshape(w, 2) / w}
  trainer = train.Trainer(loss, tx, mesh, axis_name=axis_name)
  state = trainer.init(params)
  first = state
  state, m = trainer.step(state, batch)
  fn = trainer.step_fn(state, batch)
  compiled = fn._cache_size()  # pylint: disable=protected-access
  for _ in range(steps - 1):
    state, m = trainer.step(state, batch)
  assert fn._cache_size() == compiled, "the step recompiled"  # pylint: disable=protected-access
  _same_types(first, state, "train state after steps")
  report = comm.inspect(fn, first, batch)
  assert int(m["wire_bytes"]) == round(report.wire_bytes()), (int(m["wire_bytes"]), report.table())
  return trainer, state, m, report


# ---------------------------------------------------------------------------- codecs
def check_codec(codec: codecs.Codec, x: jax.Array, key=None) -> None:
  """Payload bytes exact, packed wire dtypes, decode(encode(x)) within the error bound."""
  n = x.shape[0]
  key = jax.random.key(0) if key is None else key
  payload = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct((n,), jnp.float32), key)
  assert isinstance(payload, tuple), "a payload is a tuple of arrays"
  assert comm.tree_bytes(payload) == codec.payload_bytes(n), (codec.name, payload)
  bound_fn = codec.error_bound or (lambda x: jnp.asarray(jnp.inf))
  out, bound = jax.jit(lambda x, key: (codec.roundtrip(x, key), bound_fn(x)))(x, key)
  assert out.shape == (n,) and out.dtype == jnp.float32
  err, bound = float(jnp.max(jnp.abs(out - x))), float(bound)
  assert err <= bound, f"{codec.name}: error {err:.4g} exceeds its bound {bound:.4g}"
  np.testing.assert_array_equal(np.isfinite(out), True)


def digits_task(num_batches: int):
  """(params, loss, batches): a small MLP on digits with `num_batches` global batches of 64."""
  model = models.MLP(hidden=(16,), num_classes=10)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  ds = data.digits()
  return params, loss, [ds.batch(t, 64) for t in range(num_batches)]


def run_steps(mesh, tx, task, steps=1):
  """(trainer, state, measurements per step) after `steps` Trainer steps of `task`."""
  params, loss, batches = task
  trainer = train.Trainer(loss, tx, mesh)
  state = trainer.init(params)
  ms = []
  for t in range(steps):
    state, m = trainer.step(state, batches[t])
    ms.append(m)
  return trainer, state, ms


def flat(tree):
  """A tree as one float32 numpy vector."""
  return np.asarray(codecs.flatten(tree)[0])
