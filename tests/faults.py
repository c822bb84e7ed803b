"""The fault tests' methods and shared helpers.

The fault tests hold that every kind of state survives a kill, a restore on another process
count, and a skipped step. They run the real methods (experiments/methods/), each with the
settings (`SETTINGS`) that make it carry the state in question:

* `dp`: exact data parallelism (no state beyond the inner optimiser's momentum).
* `powersgd`: rank 2 with error feedback: a per-worker error memory and a warm-start Q
  (replicated) that changes every step.
* `diloco`: synced every `SYNC_EVERY` = 3 steps, so the checkpoints (every 4) fall
  mid-period: per-worker parameters and inner momenta, replicated outer parameters, outer
  Nesterov momentum and step counter.
* `compressed`: QSGD (a stochastic codec) with error feedback: a per-worker error memory
  and a PRNG key split every step (each worker folds in its index).

To run the fault tests on another method, add its name to `METHODS`, `MULTIHOST_METHODS`
and/or `NONFINITE_METHODS` with its settings in `SETTINGS`: every parametrised test picks it
up. The experiment (`EXPERIMENT`, a tiny MLP on digits) and the settings reach the
subprocess runs as `--config.<path>=<value>` overrides of experiments/configs/default.py
(`flag_args`) and the in-process references as the same config (`config`);
`assert_same_config` holds the two alike.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np

from experiments import build
from experiments import config as _config
from jaxcomm import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "fault_runner.py")
DEFAULT_CONFIG = os.path.join(ROOT, "experiments", "configs", "default.py")

W = 8  # workers: 8 emulated devices, in one process or two
SYNC_EVERY = 3  # of diloco

# Every method's settings of its own (config.method.<name>).
SETTINGS = {
    "dp": {},
    "powersgd": {"rank": 2, "memory": "ef"},
    "diloco": {"sync_every": SYNC_EVERY},  # checkpoints every 4 steps fall mid-period
    "compressed": {"codec": "qsgd:7", "memory": "ef"},
}
# Every method the resume tests run (experiments/methods/ names).
METHODS = ("dp", "powersgd", "diloco", "compressed")
# Methods whose multi-process run must equal the single-process one (within float error).
MULTIHOST_METHODS = ("dp", "powersgd", "diloco")
# Methods whose state must survive a skipped non-finite step untouched.
NONFINITE_METHODS = ("dp", "powersgd", "diloco", "compressed")

# The experiment the subprocess tests run: config paths and values.
EXPERIMENT = {"model.name": "mlp", "data.name": "digits", "optimizer.name": "momentum",
              "optimizer.lr": 0.05, "data.batch_size": 32, "seed": 0}


def _set(c, path: str, value) -> None:
  *parents, leaf = path.split(".")
  for part in parents:
    c = c[part]
  c[leaf] = value


def config(algo: str, steps: int, **overrides):
  """The config experiments/train.py builds from `flag_args(algo, steps)` (and overrides
  such as `checkpoint_every=4`)."""
  c = _config.base_config(algo, **SETTINGS[algo])
  for path, value in {**EXPERIMENT, "steps": steps, **overrides}.items():
    _set(c, path, value)
  return c


def flag_args(algo: str, steps: int) -> list[str]:
  """experiments/train.py's command line for `config(algo, steps)`."""
  return [f"--config={DEFAULT_CONFIG}:{algo}", f"--config.steps={steps}"] + [
      f"--config.{k}={v}" for k, v in EXPERIMENT.items()] + [
      f"--config.method.{k}={v}" for k, v in SETTINGS[algo].items()]


def assert_same_config(algo: str, steps: int, saved: dict, **overrides) -> None:
  """`saved` (the config.json experiments/train.py wrote) is `config(algo, steps,
  **overrides)`: every setting agrees, method settings and factory defaults included."""
  ours = json.loads(config(algo, steps, **overrides).to_json())
  changed = _config.differences(saved, ours)
  assert not changed, f"{algo}: {changed}"


def _program(args: list[str]) -> tuple[list[str], dict]:
  """The command line and environment of fault_runner.py (experiments/train.py)."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return [sys.executable, RUNNER, *args], env


def run_program(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
  """Runs fault_runner.py (experiments/train.py) on 8 emulated devices in a fresh process."""
  cmd, env = _program(args)
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                        env=env, check=False)


def start_program(args: list[str]) -> subprocess.Popen:
  """Starts fault_runner.py like `run_program`, without waiting; stderr is a text pipe."""
  cmd, env = _program(args)
  return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          cwd=ROOT, env=env)


def built(algo: str, steps: int) -> build.Run:
  """The run `config(algo, steps)` describes, on 8 devices (cached per test session and per XLA
  optimisation switch, like `uninterrupted`: a run built under one switch holds functions
  compiled under it, whose float32 roundings differ from the other's)."""
  return _built(algo, steps, jax.config.values["jax_disable_most_optimizations"])


@functools.lru_cache(maxsize=None)
def _built(algo: str, steps: int, unoptimised: bool) -> build.Run:
  del unoptimised  # a cache key only
  return build.build(config(algo, steps))


def uninterrupted(algo: str, steps: int):
  """(program, initial params, final state, history): the run done in this process on 8
  devices, the reference the subprocess runs are compared with (cached per test session and
  per XLA optimisation switch: conftest's `XLA_OPTIMISED` modules compile fully optimised,
  and their subprocesses too)."""
  return _uninterrupted(algo, steps, jax.config.values["jax_disable_most_optimizations"])


@functools.lru_cache(maxsize=None)
def _uninterrupted(algo: str, steps: int, unoptimised: bool):
  del unoptimised  # a cache key only: the compiles below follow the switch
  run = built(algo, steps)
  program = run.program()
  state, history = train.fit(program, program.init(run.params), run.batches, steps,
                             log_every=1, progress=False)
  return program, run.params, state, history


def restore(program, params, directory: str):
  """The newest checkpoint in `directory`, placed with `program`'s shardings."""
  state, _ = train.Checkpointer(directory).restore(program, program.init(params))
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


assert all(m in build.available_methods() for m in METHODS), "METHODS names methods"
