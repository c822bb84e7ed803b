"""experiments/train.py on islands that die, hang and rejoin (`jaxcomm.elastic`).

Elastic mode is a setting: `--config.elastic.enabled=True` (`experiments.launch_local
--elastic`, --kill, --stop or --restart set it, and start the coordination service in a
process of its own). train.py then joins the run with `jaxcomm.elastic.start_distributed`
and trains with `jaxcomm.elastic.fit` through `run` below, with the failure detection and
quorum rules of `config.elastic`.

Faults for tests and measurements come as train.py's `--fault` flag (the launcher passes
each process its own): `kill@T` (SIGKILL itself when about to take step T), `stop@T`
(SIGSTOP itself then; the launcher sends SIGCONT later), `hang@T` (its main thread sleeps
there while its other threads, heartbeats included, run on), `partition=0+1|2+3@T` (from
step T each process sees only the live processes of its own group: a network partition
seen by the membership layer). `--progress_file` is where each committed step is written
(the launcher restarts processes from it).

What an elastic run writes in --workdir (the leader of each generation): `metrics.jsonl`
(rows of the leader's workers, with the live processes), checkpoints of the live islands'
whole state (restorable by a Trainer with as many workers; `info["islands"]` maps worker
rows to processes; an elastic run does not resume from them) and `elastic.json`: the
membership events, rounds committed and discarded, steps redone, the wall time and the
goodput (steps per second).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Callable

import jax

from . import methods, specs
from jaxcomm import _validate, elastic

FAULTS = ("kill", "stop", "hang", "partition")
NO_QUORUM = 69  # exit status when no valid quorum formed (EX_UNAVAILABLE)


def round_steps(method) -> int:
  """Steps per elastic round: the sync period of the method (config.method), its module's
  `period` hook (rounds end at its syncs, so a process that joins takes part from the next
  sync; a method without one syncs every step).

  >>> from experiments import config
  >>> round_steps(config.base_config("diloco", sync_every=20).method)
  20
  >>> round_steps(config.base_config("dp").method)
  1
  """
  return _validate.integer(f"the period of method {method.name!r}",
                           methods.hooks(method.name).period(method), low=1)


def parse_faults(specs: list[str]) -> dict:
  """{kind: (step, argument)} from `--fault` values; ValueError naming the flag otherwise.

  >>> parse_faults(["kill@7", "partition=0+1|2+3@10"])
  {'kill': (7, None), 'partition': (10, [[0, 1], [2, 3]])}
  """
  out = {}
  for spec in specs:
    head, _, at = spec.rpartition("@")
    kind, _, arg = head.partition("=")
    try:
      step = int(at)
      groups = [[int(p) for p in g.split("+")] for g in arg.split("|")] if arg else None
    except ValueError:
      step = -1
    if kind not in FAULTS or step < 0 or (kind == "partition") != (groups is not None):
      raise ValueError(f"--fault: expected kill@T, stop@T, hang@T or partition=P+..|P+..@T, "
                       f"got {spec!r}.")
    out[kind] = (step, groups)
  return out


def with_faults(batch_fn: Callable[[int], dict], faults: dict) -> Callable[[int], dict]:
  """`batch_fn` that kills, stops or hangs this process when asked for the fault's step."""
  acts = {k: faults[k][0] for k in ("kill", "stop", "hang") if k in faults}
  if not acts:
    return batch_fn
  done = set()

  def batch_fn_faulty(step):
    for kind, at in acts.items():
      if step == at and kind not in done:
        done.add(kind)
        print(f"elastic_run: {kind} before step {step} [t={time.time():.3f}]",
              file=sys.stderr, flush=True)
        if kind == "kill":
          os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
          os.kill(os.getpid(), signal.SIGSTOP)
        else:
          time.sleep(3600)
    return batch_fn(step)

  return batch_fn_faulty


def partition_view(faults: dict):
  """The membership fault hook of a `partition` fault (None without one)."""
  if "partition" not in faults:
    return None
  at, groups = faults["partition"]

  def view(step, live):
    if step < at:
      return live
    mine = next(g for g in groups if jax.process_index() in g)
    return tuple(x for x in live if x[0] in mine)

  return view


def progress_writer(path: str | None) -> Callable[[int], None] | None:
  """`step -> None` writing the committed step to `path` (atomically)."""
  if not path:
    return None

  def report(step: int) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.write(str(step))
    os.replace(path + ".tmp", path)

  return report


def quorum(c):
  """`jaxcomm.elastic.Quorum` of config.elastic."""
  e = c.elastic
  return elastic.Quorum(min_workers=specs.min_workers(e.min_workers), majority=e.majority,
                        timeout_s=e.quorum_timeout_s, join_window_s=e.join_window_s,
                        shrink_only=e.shrink_only)


def run(make_program, params, batch_fn, c, *, steps: int, round_steps: int, workdir: str,
        faults: dict, progress_file: str | None) -> dict:
  """Trains with `jaxcomm.elastic.fit`; returns (and, on the last leader, writes) the
  summary. Exits with status NO_QUORUM when no valid quorum formed."""
  began = time.perf_counter()
  try:
    result = elastic.fit(
        make_program, params, with_faults(batch_fn, faults), steps, round_steps=round_steps,
        log_every=c.log_every, workdir=workdir, checkpoint_every=c.checkpoint_every,
        checkpoint_dir=os.path.join(workdir, "checkpoints"), keep=c.keep,
        timeout_s=2 * c.elastic.collective_timeout_s, quorum=quorum(c),
        deadline_s=c.elastic.deadline_s or None, view=partition_view(faults),
        on_commit=progress_writer(progress_file))
  except elastic.QuorumLost as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(NO_QUORUM)
  except elastic.Evicted as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(elastic.EVICTED)
  seconds = time.perf_counter() - began
  last = result.history[-1] if result.history else {}
  summary = {
      "process": jax.process_index(), "steps": steps, "final_loss": last.get("loss"),
      "live": last.get("live"), "rounds": result.rounds,
      "failed_rounds": result.failed_rounds, "steps_redone": result.steps_redone,
      "seconds": seconds, "steps_per_second": steps / seconds if seconds else None,
      "events": [e.__dict__ for e in result.events]}
  if result.led:
    with open(os.path.join(workdir, "elastic.json"), "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=1, default=list)
    print("elastic: " + json.dumps({k: v for k, v in summary.items() if k != "events"}),
          file=sys.stderr, flush=True)
  return summary
