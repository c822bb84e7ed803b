"""The fault tests' methods and shared helpers.

The fault tests hold that every kind of state survives a kill, a restore on another process
count, and a skipped step. They run the real registered methods (`--algo` values), each
with the settings (`SETTINGS`) that make it carry the state in question:

* `dp`: exact data parallelism (no state beyond the inner optimiser's momentum).
* `powersgd`: rank 2 with error feedback: a per-worker error memory and a warm-start Q
  (replicated) that changes every step.
* `diloco`: synced every `SYNC_EVERY` = 3 steps, so the checkpoints (every 4) fall
  mid-period: per-worker parameters and inner momenta, replicated outer parameters, outer
  Nesterov momentum and step counter.
* `compressed`: QSGD (a stochastic codec) with error feedback: a per-worker error memory
  and a PRNG key split every step (each worker folds in its index).

To run the fault tests on another method, add its `--algo` name to `METHODS`,
`MULTIHOST_METHODS` and/or `NONFINITE_METHODS` with its settings in `SETTINGS`: every
parametrised test picks it up. The experiment is `FLAGS` (a tiny MLP on digits). The
settings reach the subprocess runs as `--name=value` flags (experiments/train.py puts them
in `cfg.extra`) and the in-process references in `Config.extra`; `assert_same_config`
holds the two alike.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np

from experiments import builders
from jaxcomm import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "fault_runner.py")

W = 8  # workers: 8 emulated devices, in one process or two
SYNC_EVERY = 3  # of diloco

# Every method's settings of its own: experiments/train.py flags (the names in its
# EXTRA_FLAGS), which reach the method's builder in `cfg.extra`.
SETTINGS = {
    "dp": {},
    "powersgd": {"rank": 2, "memory": "ef"},
    "diloco": {"sync_every": SYNC_EVERY},  # checkpoints every 4 steps fall mid-period
    "compressed": {"codec": "qsgd", "bits": 4, "memory": "ef"},
}
# Every method the resume tests run (builders.ALGORITHMS names).
METHODS = ("dp", "powersgd", "diloco", "compressed")
# Methods whose multi-process run must equal the single-process one (within float error).
MULTIHOST_METHODS = ("dp", "powersgd", "diloco")
# Methods whose state must survive a skipped non-finite step untouched.
NONFINITE_METHODS = ("dp", "powersgd", "diloco", "compressed")

# The experiment the subprocess tests run, as experiments.train flags and as a Config.
FLAGS = {"model": "mlp", "dataset": "digits", "optimizer": "momentum", "lr": 0.05,
         "batch_size": 32, "seed": 0}


def config(algo: str, steps: int) -> builders.Config:
  """The Config experiments/train.py builds from `flag_args(algo, steps)` on W workers."""
  # train.py also puts the worker count in extra (local methods size their masks with it).
  return builders.Config(algo=algo, steps=steps, **FLAGS,
                         extra={**SETTINGS[algo], "num_workers": W})


def flag_args(algo: str, steps: int) -> list[str]:
  return [f"--algo={algo}", f"--steps={steps}"] + [
      f"--{k}={v}" for k, v in {**FLAGS, **SETTINGS[algo]}.items()]


class _Reads(dict):
  """A `cfg.extra` that records every setting read from it, with the value the reader got."""

  def __init__(self, *args):
    super().__init__(*args)
    self.read = {}

  def get(self, key, default=None):
    self.read[key] = super().get(key, default)
    return self.read[key]

  def __getitem__(self, key):
    self.read[key] = super().__getitem__(key)
    return self.read[key]


def settings_read(algo: str, steps: int) -> dict:
  """{setting: value} of every `cfg.extra` entry the task and method builders read."""
  cfg = config(algo, steps)
  cfg.extra = _Reads(cfg.extra)
  builders.make_task(cfg)
  builders.make_optimizer(cfg)
  return cfg.extra.read


def assert_same_config(algo: str, steps: int, saved: dict) -> None:
  """`saved` (the config.json experiments/train.py wrote) builds what `config` builds.

  Every field agrees; in `extra`, every setting the builders read has the value they read
  here (train.py's flag defaults included), and every setting of `SETTINGS` is read.
  """
  saved = dict(saved)
  ours = json.loads(json.dumps(dataclasses.asdict(config(algo, steps)), default=str))
  ours.pop("steps")
  saved.pop("skip_nonfinite", None)
  saved_extra, extra = saved.pop("extra"), ours.pop("extra")
  assert saved == ours
  read = json.loads(json.dumps(settings_read(algo, steps), default=str))
  unread = set(SETTINGS[algo]) - set(read)
  assert not unread, f"{algo}'s builder does not read its settings {unread}"
  for name, value in {**read, **extra}.items():
    assert saved_extra.get(name, value) == value, (algo, name, saved_extra.get(name), value)
  for name in extra:
    assert name in saved_extra, (algo, name)


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


assert all(m in builders.ALGORITHMS for m in METHODS), "register every method in METHODS"
