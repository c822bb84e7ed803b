"""The fault tests' methods (registered as `--algo` values) and shared helpers.

The fault tests hold that every kind of state survives a kill, a restore on another process
count, and a skipped step. Besides exact DP they use three small test-local transforms that
carry the kinds of state the real methods have:

* `toy_ef`: a per-worker error memory (error feedback around a bf16 round trip).
* `toy_schedule`: a DiLoCo-like schedule: per-worker parameters and inner momenta, a
  replicated step counter, and replicated outer parameters and Nesterov momentum, synced
  every `SYNC_EVERY` steps (checkpoints fall mid-period).
* `toy_stochastic`: PRNG keys split every step: a replicated (shared) key drawing a random
  mask and a per-worker key drawing dither noise.

To run the fault tests on a real method, add its `--algo` name to `METHODS`,
`MULTIHOST_METHODS` and/or `NONFINITE_METHODS` (and register a builder below if
`experiments.builders` does not have one yet): every parametrised test picks it up. The
experiment is `FLAGS` (a tiny MLP on digits); a method that needs settings of its own reads
them from `cfg.extra` in its builder.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from experiments import builders
from jaxcomm import codecs, comm, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "fault_runner.py")

# Every method the resume / multi-host tests run (builders.ALGORITHMS names).
METHODS = ("dp", "toy_ef", "toy_schedule", "toy_stochastic")
# Methods whose multi-process run must equal the single-process one (within float error).
MULTIHOST_METHODS = ("dp", "toy_schedule")
# Methods whose state must survive a skipped non-finite step untouched.
NONFINITE_METHODS = ("dp", "toy_ef", "toy_schedule")
SYNC_EVERY = 3

# The experiment the subprocess tests run, as experiments.train flags and as a Config.
FLAGS = {"model": "mlp", "dataset": "digits", "optimizer": "momentum", "lr": 0.05,
         "batch_size": 32, "seed": 0}


def config(algo: str, steps: int) -> builders.Config:
  return builders.Config(algo=algo, steps=steps, **FLAGS)


def flag_args(algo: str, steps: int) -> list[str]:
  return [f"--algo={algo}", f"--steps={steps}"] + [f"--{k}={v}" for k, v in FLAGS.items()]


def run_program(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
  """Runs fault_runner.py (experiments/train.py) on 8 emulated devices in a fresh process."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, RUNNER, *args], capture_output=True, text=True,
                        timeout=timeout, cwd=ROOT, env=env, check=False)


@functools.lru_cache(maxsize=None)
def uninterrupted(algo: str, steps: int):
  """(trainer, initial params, final state, history): the run done in this process on 8
  devices, the reference the subprocess runs are compared with (cached per test session)."""
  cfg = config(algo, steps)
  _, loss, params, batch_fn, has_aux = builders.make_task(cfg)
  trainer = train.Trainer(loss, builders.make_optimizer(cfg), train.make_mesh({"data": 8}),
                          has_aux=has_aux)
  state, history = train.fit(trainer, trainer.init(params), batch_fn, steps, log_every=1,
                             progress=False)
  return trainer, params, state, history


def restore(trainer, params, directory: str):
  """The newest checkpoint in `directory`, placed with `trainer`'s shardings."""
  state, _ = train.Checkpointer(directory).restore(trainer, trainer.init(params))
  return state


def key_data(tree):
  """Typed PRNG keys as their uint32 data (so trees with keys compare with numpy tools)."""
  return jax.tree.map(lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x, tree)


def assert_bitwise_equal(a, b) -> None:
  """Same structure, dtypes, shapes and bytes, leaf by leaf."""
  paths_a = jax.tree_util.tree_leaves_with_path(key_data(a))
  paths_b = jax.tree_util.tree_leaves_with_path(key_data(b))
  for (path, x), (path_b, y) in zip(paths_a, paths_b, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert path == path_b and x.dtype == y.dtype and x.shape == y.shape, path
    assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)} differs"


# ------------------------------------------------------------------- error feedback
class ToyEfState(NamedTuple):
  error: Any             # per-worker error memory, shaped like the parameters
  wire_bytes: jax.Array  # u32[]


def toy_ef(axis_name) -> optax.GradientTransformation:
  """Error feedback around a bf16 round trip, then the exact mean of what was sent."""
  codec = codecs.cast("bfloat16")

  def init_fn(params):
    return ToyEfState(jax.tree.map(jnp.zeros_like, params), comm.zero_bytes())

  def update_fn(updates, state, params=None):
    del params
    corrected = jax.tree.map(jnp.add, updates, state.error)
    sent = jax.tree.map(lambda x: codec.roundtrip(x.ravel()).reshape(x.shape), corrected)
    error = jax.tree.map(jnp.subtract, corrected, sent)
    mean, nbytes = comm.mean(sent, axis_name, dtype=jnp.bfloat16)
    return mean, ToyEfState(error, comm.add_bytes(state.wire_bytes, nbytes))

  return optax.GradientTransformation(init_fn, update_fn)


# ------------------------------------------------------------------- sync every H steps
class ToyScheduleState(NamedTuple):
  count: jax.Array       # i32[]: inner steps taken (replicated)
  outer_params: Any      # replicated parameters of the last sync
  outer_momentum: Any    # replicated Nesterov momentum of the outer step
  inner_state: Any       # the inner optimiser's state (per-worker)
  wire_bytes: jax.Array  # u32[]


def toy_schedule(inner, axis_name, sync_every=SYNC_EVERY, outer_lr=0.7,
                  momentum=0.9) -> optax.GradientTransformation:
  """Local steps of `inner`; every `sync_every` steps a Nesterov outer step on the mean."""

  def init_fn(params):
    return ToyScheduleState(jnp.zeros((), jnp.int32), params,
                             jax.tree.map(jnp.zeros_like, params), inner.init(params),
                             comm.zero_bytes())

  def update_fn(updates, state, params):
    local, inner_state = inner.update(updates, state.inner_state, params)
    worker = optax.apply_updates(params, local)

    def outer_step():
      mean, nbytes = comm.mean(worker, axis_name)
      delta = jax.tree.map(jnp.subtract, state.outer_params, mean)
      mom = jax.tree.map(lambda m, d: momentum * m + d, state.outer_momentum, delta)
      outer = jax.tree.map(lambda o, m, d: o - outer_lr * (d + momentum * m),
                           state.outer_params, mom, delta)
      to_outer = comm.varying(jax.tree.map(jnp.subtract, outer, params), axis_name)
      return to_outer, outer, mom, comm.add_bytes(state.wire_bytes, nbytes)

    def local_step():
      return (comm.varying(local, axis_name), state.outer_params, state.outer_momentum,
              state.wire_bytes)

    synced = (state.count + 1) % sync_every == 0
    new_updates, outer, mom, nbytes = lax.cond(synced, outer_step, local_step)
    return new_updates, ToyScheduleState(state.count + 1, outer, mom, inner_state, nbytes)

  return optax.GradientTransformation(init_fn, update_fn)


# ------------------------------------------------------------------- PRNG keys
class ToyStochasticState(NamedTuple):
  shared_key: jax.Array  # key[]: the same on every worker (the mask)
  worker_key: jax.Array  # key[]: per worker (the dither)
  wire_bytes: jax.Array  # u32[]


def toy_stochastic(axis_name, keep=0.5, dither=1e-3) -> optax.GradientTransformation:
  """Keeps a random half of the coordinates (shared mask, rescaled) plus per-worker dither."""

  def init_fn(params):
    del params
    key = jax.random.key(42)
    return ToyStochasticState(key, jax.random.fold_in(key, 1), comm.zero_bytes())

  def update_fn(updates, state, params=None):
    del params
    shared_key, mask_key = jax.random.split(state.shared_key)
    index = lax.axis_index(axis_name) if axis_name is not None else 0
    worker_key, noise_key = jax.random.split(jax.random.fold_in(state.worker_key, index))
    leaves, treedef = jax.tree.flatten(updates)
    out = []
    for i, g in enumerate(leaves):
      mask = jax.random.bernoulli(jax.random.fold_in(mask_key, i), keep, g.shape)
      noise = dither * jax.random.normal(jax.random.fold_in(noise_key, i), g.shape)
      out.append(jnp.where(mask, g / keep, 0.0) + noise)
    mean, nbytes = comm.mean(jax.tree.unflatten(treedef, out), axis_name)
    return mean, ToyStochasticState(shared_key, worker_key,
                                     comm.add_bytes(state.wire_bytes, nbytes))

  return optax.GradientTransformation(init_fn, update_fn)


# ------------------------------------------------------------------- registration
@builders.algorithm("toy_ef")
def _ef(cfg, inner):
  return optax.chain(toy_ef(cfg.axis_name), inner)


@builders.algorithm("toy_schedule")
def _schedule(cfg, inner):
  return toy_schedule(inner, cfg.axis_name)


@builders.algorithm("toy_stochastic")
def _stochastic(cfg, inner):
  return optax.chain(toy_stochastic(cfg.axis_name), inner)


assert all(m in builders.ALGORITHMS for m in METHODS), "register every method in METHODS"
