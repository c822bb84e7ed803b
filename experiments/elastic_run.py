"""experiments/train.py on islands that die and rejoin (`jaxcomm.elastic`).

`experiments.launch_local --elastic` (or --kill / --restart) starts the processes with
JAXCOMM_ELASTIC=1 in their environment; train.py then starts `jax.distributed` with
`jaxcomm.elastic.start_distributed` and trains with `jaxcomm.elastic.fit` through `run`
below. The same environment arms the failure schedule: JAXCOMM_KILL_AT=T makes this process
SIGKILL itself when it is about to take step T, and each committed step is written to the
file JAXCOMM_PROGRESS (the launcher restarts processes from it). JAXCOMM_MIN_ISLANDS=N@T
makes rounds from step T on wait until N islands are live (a quorum; e.g. to hold the
survivors until a restarted process is back).

What an elastic run writes in --workdir (process 0): `metrics.jsonl` (rows of process 0's
workers, with the live processes), checkpoints of the live islands' whole state (restorable
by a Trainer with as many workers; `info["islands"]` maps worker rows to processes; an
elastic run does not resume from them) and `elastic.json`: the membership events, rounds
committed and discarded, steps redone, the wall time and the goodput (steps per second).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Callable

# Methods whose sync period is `sync_every` (rounds end at their syncs, so a process that
# joins takes part from the next outer sync); every other method syncs each step.
PERIODIC = ("diloco", "local_sgd", "sparseloco", "streaming_diloco")


def requested() -> bool:
  """Whether this process was started as part of an elastic run."""
  return os.environ.get("JAXCOMM_ELASTIC") == "1"


def collective_timeout_s(default: int = 30) -> int:
  """The CPU collective timeout the launcher put in XLA_FLAGS (or `default`)."""
  for flag in os.environ.get("XLA_FLAGS", "").split():
    if flag.startswith("--xla_cpu_collective_timeout_seconds="):
      return int(flag.split("=", 1)[1])
  return default


def round_steps(algo: str, sync_every: int) -> int:
  """Steps per elastic round: the method's sync period.

  >>> round_steps("diloco", 20), round_steps("dp", 20)
  (20, 1)
  """
  return sync_every if algo in PERIODIC else 1


def with_kill_switch(batch_fn: Callable[[int], dict]) -> Callable[[int], dict]:
  """`batch_fn` that SIGKILLs this process when asked for step JAXCOMM_KILL_AT."""
  at = os.environ.get("JAXCOMM_KILL_AT")
  if at is None:
    return batch_fn

  def batch_fn_killing(step):
    if step == int(at):
      print(f"elastic_run: SIGKILL before step {step}", file=sys.stderr, flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    return batch_fn(step)

  return batch_fn_killing


def min_islands(spec: str | None) -> Callable[[int], int]:
  """`step -> islands a round needs`, from JAXCOMM_MIN_ISLANDS="N@T,...": N from step T on.

  >>> f = min_islands("3@40")
  >>> f(39), f(40)
  (1, 3)
  """
  rules = sorted((int(t), int(n)) for n, t in (r.split("@") for r in (spec or "").split(",")
                                               if r))
  return lambda step: max([n for t, n in rules if step >= t] or [1])


def report_progress(step: int) -> None:
  """Writes the committed step to JAXCOMM_PROGRESS (atomically)."""
  path = os.environ.get("JAXCOMM_PROGRESS")
  if not path:
    return
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(str(step))
  os.replace(path + ".tmp", path)


def run(make_trainer, params, batch_fn, *, steps: int, round_steps: int, workdir: str,
        checkpoint_every: int, keep: int, log_every: int) -> dict:
  """Trains with `jaxcomm.elastic.fit`; returns (and on process 0 writes) the summary."""
  import jax  # pylint: disable=import-outside-toplevel
  from jaxcomm import elastic, train  # pylint: disable=import-outside-toplevel
  checkpointer = None
  if checkpoint_every and jax.process_index() == 0:
    checkpointer = train.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      every=checkpoint_every, keep=keep, processes={0})
  began = time.perf_counter()
  result = elastic.fit(make_trainer, params, batch_fn, steps,
                       round_steps=round_steps, log_every=log_every, workdir=workdir,
                       checkpoint_every=checkpoint_every, checkpointer=checkpointer,
                       timeout_s=2 * collective_timeout_s(), on_commit=report_progress,
                       min_islands=min_islands(os.environ.get("JAXCOMM_MIN_ISLANDS")))
  seconds = time.perf_counter() - began
  if checkpointer is not None:
    checkpointer.close()
  last = result.history[-1] if result.history else {}
  summary = {
      "process": jax.process_index(), "steps": steps, "final_loss": last.get("loss"),
      "live": last.get("live"), "rounds": result.rounds,
      "failed_rounds": result.failed_rounds, "steps_redone": result.steps_redone,
      "seconds": seconds, "steps_per_second": steps / seconds if seconds else None,
      "events": [e.__dict__ for e in result.events]}
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "elastic.json"), "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=1, default=list)
    print("elastic: " + json.dumps({k: v for k, v in summary.items() if k != "events"}),
          file=sys.stderr, flush=True)
  return summary
