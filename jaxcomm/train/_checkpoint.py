"""Orbax checkpoints of the whole train state: a killed run resumes bit for bit.

What is saved: the `TrainState` as it is, every leaf with its sharding: parameters (with the
leading worker axis where they are per-worker), and the optimiser state of every transform
(error memories, warm-start matrices, outer parameters and momenta, counters, PRNG keys).
Typed PRNG keys are stored as their key data (uint32) and wrapped again on restore with the
implementation of the template's key. Nothing else is needed to continue a run:

* **The data position is the step.** jaxcomm's batches are a pure function of
  `(seed, step)` (`jaxcomm.data`), so `state.step` says where the data resumes. A `batch_fn`
  that keeps hidden state of its own (an iterator) would not resume exactly.
* **Small extras** (the loop's running byte total) travel in a JSON item next to the state.

Saving goes through `orbax.checkpoint.CheckpointManager`: every `every` steps (and whenever
JAX's preemption notice says so on a multi-host run), keeping the last `keep`. A save is
written to a temporary directory and renamed into place when complete, so a save interrupted
half-way leaves the previous checkpoints as they were (the temporary directory is removed
when the next run starts). The JSON item also holds a fingerprint of the saved values; on
restore the fingerprint of what was read must match, so a checkpoint whose files were
damaged after the fact (truncated, removed) is detected even where the reader would not
notice. Restoring walks back from the newest checkpoint: an unreadable one is skipped with a
logged warning and moved aside (renamed `<step>.unreadable`) once an older one restores; if
none can be read the restore raises instead of silently starting over.

Multi-host: every process calls `save` and `restore`; Orbax writes each array once (each
process its own shards, replicated values from one process) and JSON from process 0. The
processes agree on whether a restore succeeded before using it.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.train import _validate
from jaxcomm.train._program import Program
from jaxcomm.train._step import TrainState

logger = logging.getLogger(__name__)

_UNREADABLE = ".unreadable"


class Checkpointer:
  """Saves a `TrainState` every `every` steps into `directory`, keeping the last `keep`.

  Args:
    directory: where the checkpoints go (one subdirectory per step).
    every: save when the step is a multiple of this (and at the end of `fit`).
    keep: how many of the newest checkpoints to keep.
    async_save: write in a background thread while training continues.
    processes: None (every process saves and restores its shards) or a set of one process
      that does it alone, holding the whole state (`{0}`: `jaxcomm.elastic` gathers the
      live islands' state on process 0, since the others may be dead).

  >>> import tempfile, jax.numpy as jnp, optax
  >>> from jaxcomm import sync
  >>> from jaxcomm.train import make_mesh, make_program
  >>> program = make_program(lambda p, b: jnp.mean((b["x"] * p["w"]) ** 2),
  ...                        optax.chain(sync.mean("data"), optax.adam(0.1)),
  ...                        make_mesh({"data": 8}), {"w": jnp.ones(())})
  >>> state, _, _ = program.step(program.init({"w": jnp.ones(())}), {"x": jnp.ones(8)})
  >>> ckpt = Checkpointer(tempfile.mkdtemp(), every=1, keep=2)
  >>> ckpt.save(state, force=True)
  True
  >>> restored, info = ckpt.restore(program, program.init({"w": jnp.ones(())}))
  >>> int(restored.step), bool(restored.params["w"] == state.params["w"]), ckpt.steps
  (1, True, [1])
  """

  def __init__(self, directory: str, *, every: int = 100, keep: int = 3,
               async_save: bool = True, processes: set[int] | None = None):
    directory, every, keep = _validate.checkpoint_args(directory, every, keep)
    self.directory = os.path.abspath(directory)
    self.every, self.keep = every, keep
    self.processes = _validate.checkpoint_processes(processes)
    self._preemption = (None, False)  # (step asked about, answer)
    if self.processes is not None:  # Orbax creates the directory only when all processes save
      os.makedirs(self.directory, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=every, max_to_keep=keep, create=self.processes is None,
        enable_async_checkpointing=async_save, cleanup_tmp_directories=True,
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=min(self.processes) if self.processes else 0,
            active_processes=self.processes))
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "meta"))

  @property
  def steps(self) -> list[int]:
    """Steps of the checkpoints on disk (complete saves only), oldest first."""
    return sorted(self._manager.all_steps())

  def due(self, step: int, *, force: bool = False) -> bool:
    """Whether `save` would save a state at `step` (not saved yet, and due or `force`)."""
    if step in self._manager.all_steps():
      return False
    # Orbax's own policy would also save the first step of a run; ours is every `every`.
    return force or step % self.every == 0 or self.reached_preemption(step)

  def save(self, state: TrainState, *, force: bool = False, info: dict | None = None,
           step: int | None = None) -> bool:
    """Saves `state` if its step is due (or `force`); returns whether a save started.

    Args:
      state: the train state (on every process; with `processes={i}`, on process i as
        numpy arrays, e.g. from `jaxcomm.elastic.gather`).
      force: save whatever the step (the end of a run); a step saved already is not saved
        twice.
      info: small JSON-serialisable extras restored alongside the state.
      step: `state.step` when the caller knows it (saves waiting for the device to say).
    """
    step = int(np.asarray(state.step)) if step is None else step
    if not self.due(step, force=force):
      return False
    stored = _storable(state)
    meta = {"step": step, "fingerprint": self._fingerprint(stored), "info": info or {},
            "data_position": "batches are a pure function of (seed, step): the step suffices"}
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(stored),
                                                     meta=ocp.args.JsonSave(meta)),
                       force=True)
    return True

  def reached_preemption(self, step: int) -> bool:
    """Whether JAX's preemption notice asks every process to save and stop at `step`.

    Asked once per step (the answer is remembered): on a multi-host run each question is a
    step of JAX's preemption sync protocol.
    """
    if self._preemption[0] != step:
      self._preemption = (step, self._manager.reached_preemption(step))
    return self._preemption[1]

  def restore(self, program: Program, state_like: TrainState
              ) -> tuple[TrainState, dict] | None:
    """The newest readable checkpoint as `(state, info)`, or None when there is none.

    Args:
      program: the `Program` the state is for; its `state_shardings` place every leaf (a
        run may resume on another mesh or process count with the same number of workers).
      state_like: a train state of the same structure (e.g. `program.init(params)`); typed
        PRNG keys are re-wrapped with its keys' implementations.

    Raises:
      RuntimeError: checkpoints exist but none of them can be read.
    """
    shardings = program.state_shardings()
    target = jax.tree.map(_abstract, state_like, shardings)
    unreadable = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        error = _check(out, step, self._fingerprint(out["state"]))
      except Exception as e:
        error = f"{type(e).__name__}: {e}"
      if self._all_agree(error is None):
        if unreadable:
          self._set_aside(unreadable)
        state = jax.tree.map(_unstorable, out["state"], state_like)
        return state, out["meta"].get("info", {})
      why = (error or "it failed on another process")[:500]
      logger.warning("checkpoint at step %d in %s cannot be restored (%s); trying the "
                     "previous one.", step, self.directory, why)
      unreadable.append(step)
    if unreadable:
      raise RuntimeError(f"none of the checkpoints {sorted(unreadable)} in {self.directory} "
                         f"can be restored (see the warnings above); move them away to start "
                         f"over.")
    return None

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  # ---------------------------------------------------------------- helpers
  def _all_agree(self, ok: bool) -> bool:
    return ok if self.processes is not None else _all_processes_agree(ok)

  def _fingerprint(self, stored: Any) -> list[int]:
    leaves = jax.tree.leaves(stored)
    if isinstance(leaves[0], jax.Array):
      fn = _fingerprint_fn(leaves[0].sharding.mesh)
    else:  # host arrays (a state gathered on one process), summed on this process's device
      fn = _fingerprint_fn(None)
    return [int(x) for x in np.asarray(fn(leaves))]

  def _set_aside(self, steps: list[int]) -> None:
    self.wait()
    if jax.process_index() == 0:
      for step in steps:
        path = os.path.join(self.directory, str(step))
        if os.path.exists(path):
          os.replace(path, path + _UNREADABLE)
    if jax.process_count() > 1 and self.processes is None:
      multihost_utils.sync_global_devices("jaxcomm_checkpoint_set_aside")
    self._manager.reload()


def _is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _storable(tree: Any) -> Any:
  """Typed PRNG keys as their uint32 key data (same leading axes and sharding)."""
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _unstorable(x: jax.Array, like: Any) -> jax.Array:
  return jax.random.wrap_key_data(x, impl=jax.random.key_impl(like)) if _is_key(like) else x


def _abstract(like: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
  """What Orbax should read for one leaf: its stored shape and dtype, on `sharding`."""
  stored = jax.eval_shape(jax.random.key_data, like) if _is_key(like) else like
  return jax.ShapeDtypeStruct(stored.shape, stored.dtype, sharding=sharding)


@functools.lru_cache(maxsize=None)
def _fingerprint_fn(mesh: jax.sharding.Mesh | None):
  """u32[leaves]: one position-sensitive checksum per leaf, computed where the data lives."""
  return jax.jit(lambda leaves: jnp.stack([_leaf_fingerprint(x) for x in leaves]),
                 out_shardings=None if mesh is None else NamedSharding(mesh, P()))


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
  """Sum over elements of bits * (odd multiplier of the position), modulo 2**32."""
  x = jnp.ravel(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  if jnp.issubdtype(x.dtype, jnp.floating):
    x = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[
        x.dtype.itemsize])
  bits = x.astype(jnp.uint32)
  weights = jnp.arange(x.shape[0], dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
  return jnp.sum(bits * weights, dtype=jnp.uint32)


def _check(out: Any, step: int, fingerprint: list[int]) -> str | None:
  meta = out["meta"]
  if meta.get("step") != step:
    return f"the checkpoint says step {meta.get('step')}, its directory says {step}"
  if meta.get("fingerprint") != fingerprint:
    return "the values read differ from the values saved (fingerprint mismatch)"
  return None


def _all_processes_agree(ok: bool) -> bool:
  """True when `ok` holds on every process (a restore is used only if all of them read it)."""
  if jax.process_count() == 1:
    return ok
  flags = multihost_utils.process_allgather(np.asarray(ok, np.int32))
  return bool(np.all(flags))
