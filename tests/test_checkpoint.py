"""Checkpoints: a SIGKILLed run resumes bit for bit; a SIGTERMed one saves the step it is at
and stops; a damaged or half-written checkpoint is skipped with a warning and the previous
one is used.

The subprocess tests run the real program (`experiments/train.py`, through
`tests/fault_runner.py`) and compare with the same training done here, uninterrupted, on the
same 8 emulated devices. The methods come from `faults.METHODS`: add a method there to
put it through every check.
"""

import json
import os
import random
import re
import shutil
import signal
import threading

import jax
import numpy as np
import optax
import pytest

import faults
from jaxcomm import train

STEPS, EVERY = 12, 4
PREEMPTED = 143  # experiments.train.PREEMPTED: the exit status of a run stopped by SIGTERM


def kill_step(algo):
  return random.Random(algo).randrange(EVERY + 1, STEPS)  # a random step after a checkpoint


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
  """Every method SIGKILLed at a random step, then all resumed by one process.

  Returns {algo: (its workdir, the step it resumed from)}.
  """
  base = tmp_path_factory.mktemp("resume")
  common = [f"--config.checkpoint_every={EVERY}", "--config.keep=2", "--config.log_every=1"]
  for algo in faults.METHODS:
    args = faults.flag_args(algo, STEPS) + [f"--workdir={base / algo}"] + common
    killed = faults.run_program(args + [f"--kill_at={kill_step(algo)}"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert f"SIGKILL at step {kill_step(algo)}" in killed.stderr
  resumed = faults.run_program(faults.flag_args("dp", STEPS) + common + [
      f"--workdir={base}", f"--algos={','.join(faults.METHODS)}"])
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  starts = {path: int(step) for step, path in re.findall(
      r"resumed from the checkpoint at step (\d+) in (\S+)", resumed.stderr)}
  return {algo: (base / algo, starts.get(str(base / algo / "checkpoints")))
          for algo in faults.METHODS}


@pytest.mark.slow
@pytest.mark.parametrize("algo", faults.METHODS)
def test_sigkilled_run_resumes_bit_for_bit(algo, resumed_runs):
  workdir, start = resumed_runs[algo]
  assert start is not None and EVERY <= start <= kill_step(algo) and start % EVERY == 0

  program, params, reference, history = faults.uninterrupted(algo, STEPS)
  final = faults.restore(program, params, str(workdir / "checkpoints"))
  assert int(final.step) == STEPS
  faults.assert_bitwise_equal(final, reference)  # params, memories, counters, outer state, keys
  # The metrics of the two runs together are those of one run: each step once, same values.
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  for row, ref in zip(rows, history):
    assert (row["loss"], row["total_wire_bytes"]) == (ref["loss"], ref["total_wire_bytes"])
  # Only the last --keep checkpoints are kept.
  assert train.Checkpointer(str(workdir / "checkpoints")).steps == [STEPS - EVERY, STEPS]


@pytest.mark.slow
@pytest.mark.parametrize("algo", faults.METHODS)
def test_program_and_reference_build_the_method_alike(algo, resumed_runs):
  """The settings train.py used (its config.json) are those of the in-process reference."""
  workdir, _ = resumed_runs[algo]
  faults.assert_same_config(algo, STEPS, json.loads((workdir / "config.json").read_text()),
                            checkpoint_every=EVERY, keep=2, log_every=1)


def _per_worker_and_distinct(tree):
  """Every leaf has a leading worker axis; some leaf is nonzero and differs across workers."""
  leaves = [np.asarray(x) for x in jax.tree.leaves(faults.key_data(tree))]
  assert leaves and all(x.shape[0] == faults.W for x in leaves)
  return any(np.any(x != 0) and np.any(x != x[:1]) for x in leaves)


def _changed(a, b):
  return any(np.any(np.asarray(x) != np.asarray(y)) for x, y in zip(
      jax.tree.leaves(faults.key_data(a)), jax.tree.leaves(faults.key_data(b)), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["powersgd", "diloco", "compressed"])
def test_the_resumed_checkpoint_holds_the_method_state(algo, resumed_runs):
  """At the step it resumed from, each real method carries the state the resume must keep."""
  _, start = resumed_runs[algo]
  program, params, _, _ = faults.uninterrupted(algo, STEPS)
  batch_fn = faults.built(algo, STEPS).batches
  state = program.init(params)
  init = jax.tree.map(np.asarray, faults.key_data(state))  # the step consumes (donates) state
  state, _ = train.fit(program, state, batch_fn, start, progress=False)
  get = lambda s, name: optax.tree_utils.tree_get(s.opt_state, name)
  if algo == "powersgd":  # per-worker error memory; the warm-start Q moved on
    assert _per_worker_and_distinct(get(state, "error"))
    assert _changed(get(state, "q"), get(init, "q"))
  elif algo == "diloco":  # mid-period: worker parameters apart, outer parameters synced before
    assert start % faults.SYNC_EVERY != 0 and int(get(state, "count")) == start
    assert _per_worker_and_distinct(state.params)
    assert _changed(get(state, "outer_params"), get(init, "outer_params"))
  else:  # per-worker error memory; the stochastic codec's key advanced
    assert _per_worker_and_distinct(get(state, "memory"))
    assert _changed(get(state, "key"), get(init, "key"))


TERM_AT = 6  # SIGTERM arrives before step 6 -> 7 runs: the run saves step 7, not only 4


@pytest.mark.slow
def test_sigterm_saves_the_step_under_way_and_resumes_bit_for_bit(tmp_path):
  algo = "diloco"  # per-worker parameters mid-period at step 7
  proc = faults.start_program(faults.flag_args(algo, STEPS) + [
      f"--workdir={tmp_path}", f"--config.checkpoint_every={EVERY}", "--config.log_every=1",
      f"--term_at={TERM_AT}"])
  deadline = threading.Timer(180, proc.kill)  # a runner that never gets there fails the test
  deadline.start()
  try:
    stderr = ""
    for line in proc.stderr:  # the runner waits at step TERM_AT until the signal arrives
      stderr += line
      if f"waiting for SIGTERM at step {TERM_AT}" in line:
        proc.send_signal(signal.SIGTERM)
        break
    stderr += proc.communicate(timeout=120)[1]
  finally:
    deadline.cancel()
    proc.kill()
  assert proc.returncode == PREEMPTED, stderr[-3000:]
  assert f"preempted at step {TERM_AT + 1} of {STEPS}" in stderr
  checkpoints = str(tmp_path / "checkpoints")
  assert train.Checkpointer(checkpoints).steps == [EVERY, TERM_AT + 1]  # nothing lost

  program, params, reference, _ = faults.uninterrupted(algo, STEPS)
  batch_fn = faults.built(algo, STEPS).batches
  ckpt = train.Checkpointer(checkpoints, every=EVERY)
  assert int(ckpt.restore(program, program.init(params))[0].step) == TERM_AT + 1
  state, _ = train.fit(program, program.init(params), batch_fn, STEPS, progress=False,
                       checkpointer=ckpt)
  faults.assert_bitwise_equal(state, reference)


def test_sigterm_in_fit_is_taken_only_with_a_checkpointer(saved_run, tmp_path):
  """fit notes SIGTERM (and saves the step) only while it has a checkpointer to save with."""
  program, params, batch_fn, _, _ = saved_run

  def batch_fn_term(t):
    if t == 2:  # arrives while step 2 -> 3 runs
      os.kill(os.getpid(), signal.SIGTERM)
    return batch_fn(t)

  caught = []
  ours = lambda signum, frame: caught.append(signum)
  previous = signal.signal(signal.SIGTERM, ours)  # so a signal fit misses fails the test only
  try:
    ckpt = train.Checkpointer(str(tmp_path / "ckpt"), every=100)
    state, _ = train.fit(program, program.init(params), batch_fn_term, 6, progress=False,
                         checkpointer=ckpt)
    assert int(state.step) == 3 and ckpt.steps == [3] and not caught
    assert signal.getsignal(signal.SIGTERM) is ours  # fit put the handler back
    state, _ = train.fit(program, program.init(params), batch_fn_term, 6, progress=False)
    assert int(state.step) == 6 and caught == [signal.SIGTERM]
  finally:
    signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------- damaged checkpoints
def _files(step_dir, pattern=""):
  return [os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs
          if pattern in os.path.join(d, f)]


def _truncate(step_dir):
  for f in _files(step_dir, f"{os.sep}d{os.sep}"):  # the array data files
    os.truncate(f, os.path.getsize(f) // 2)


def _remove(step_dir):
  for f in _files(step_dir, f"{os.sep}d{os.sep}"):
    os.remove(f)


def _remove_item(step_dir):
  shutil.rmtree(os.path.join(step_dir, "state"))


def _flip(step_dir):
  """Changes bytes in place (same size): OCDBT's checksums catch it."""
  for f in _files(step_dir, f"{os.sep}d{os.sep}"):
    with open(f, "r+b") as fh:
      data = bytearray(fh.read())
      for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
      fh.seek(0)
      fh.write(data)


def _mixed_up(step_dir):
  """The arrays of another step under this step's metadata: only the fingerprint can tell."""
  shutil.rmtree(os.path.join(step_dir, "state"))
  shutil.copytree(os.path.join(os.path.dirname(step_dir), "4", "state"),
                  os.path.join(step_dir, "state"))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """A run with per-worker state checkpointed at steps 2, 4, 6 (and its final state)."""
  program, params, reference, _ = faults.uninterrupted("powersgd", 6)
  directory = str(tmp_path_factory.mktemp("ckpt"))
  batch_fn = faults.built("powersgd", 6).batches
  ckpt = train.Checkpointer(directory, every=2, keep=3)
  state, _ = train.fit(program, program.init(params), batch_fn, 6, progress=False,
                       checkpointer=ckpt)
  assert ckpt.steps == [2, 4, 6]
  faults.assert_bitwise_equal(state, reference)
  return program, params, batch_fn, reference, directory


@pytest.mark.parametrize(
    "damage", [_truncate, _remove, _remove_item, _flip, _mixed_up],
    ids=["truncated", "files_removed", "item_removed", "bytes_flipped", "arrays_of_step_4"])
def test_damaged_newest_checkpoint_is_skipped_with_a_warning(saved_run, damage, tmp_path,
                                                             caplog):
  program, params, batch_fn, reference, source = saved_run
  directory = str(tmp_path / "ckpt")
  shutil.copytree(source, directory)
  damage(os.path.join(directory, "6"))
  ckpt = train.Checkpointer(directory, every=2, keep=3)
  with caplog.at_level("WARNING", logger="jaxcomm.train._checkpoint"):
    state, _ = ckpt.restore(program, program.init(params))
  assert int(state.step) == 4
  assert any("step 6" in r.getMessage() and "cannot be restored" in r.getMessage()
             for r in caplog.records)
  assert ckpt.steps == [2, 4] and os.path.isdir(os.path.join(directory, "6.unreadable"))
  # The run goes on from step 4, saves step 6 again and ends where the intact run ended.
  state, _ = train.fit(program, state, batch_fn, 6, progress=False, checkpointer=ckpt)
  faults.assert_bitwise_equal(state, reference)
  assert ckpt.steps == [2, 4, 6]


def test_half_written_save_leaves_the_previous_checkpoint(saved_run, tmp_path):
  program, params, batch_fn, reference, source = saved_run
  directory = str(tmp_path / "ckpt")
  shutil.copytree(source, directory)
  # What a save killed half-way leaves: Orbax writes into a temporary directory and renames
  # it into place only when complete.
  partial = os.path.join(directory, "8.orbax-checkpoint-tmp")
  shutil.copytree(os.path.join(directory, "6"), partial)
  _truncate(partial)
  ckpt = train.Checkpointer(directory, every=2, keep=3)
  assert ckpt.steps == [2, 4, 6]
  state, _ = ckpt.restore(program, program.init(params))
  faults.assert_bitwise_equal(state, reference)
  # The run goes on and saves step 8 over the remains of the interrupted save.
  state, _ = train.fit(program, state, batch_fn, 8, progress=False, checkpointer=ckpt)
  assert ckpt.steps == [4, 6, 8]
  faults.assert_bitwise_equal(faults.restore(program, params, directory), state)


def test_no_readable_checkpoint_raises_instead_of_starting_over(saved_run, tmp_path):
  program, params, _, _, source = saved_run
  directory = str(tmp_path / "ckpt")
  shutil.copytree(source, directory)
  for step in (2, 4, 6):
    _truncate(os.path.join(directory, str(step)))
  with pytest.raises(RuntimeError, match="none of the checkpoints"):
    train.Checkpointer(directory).restore(program, program.init(params))
  assert sorted(os.listdir(directory)) == ["2", "4", "6"]  # nothing moved or deleted


def test_empty_directory_restores_nothing(saved_run, tmp_path):
  program, params, _, _, _ = saved_run
  assert train.Checkpointer(str(tmp_path / "none")).restore(program,
                                                            program.init(params)) is None


def test_restore_places_per_worker_leaves_with_the_program_shardings(saved_run):
  program, params, _, reference, source = saved_run
  state = faults.restore(program, params, source)
  want = program.state_shardings()
  for x, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    assert x.sharding.is_equivalent_to(sharding, x.ndim)
  error = state.opt_state[0].error  # the per-worker memory keeps its leading worker axis
  assert jax.tree.leaves(error)[0].shape[0] == 8
  faults.assert_bitwise_equal(state, reference)
