r"""Goodput under a failure: elastic training against restarting everything from a checkpoint.

  python -m experiments.elastic_goodput --repeats=2 --workdir=runs/goodput

Runs the same multi-process experiment (experiments/train.py through launch_local, one
device per process, on loopback) four ways, one after the other, and reports the useful
steps per second of each (the run's steps over its wall time, start-up and compiles
included) and its ratio to the ordinary run without failures:

* `plain`: an ordinary run, no failure (the reference);
* `elastic`: the same with `jaxcomm.elastic`, no failure (what membership rounds cost);
* `elastic+kill`: process 2 is SIGKILLed before step --kill_at and restarted once a live
  process has committed --restart_at; the others train on and heal it when it is back;
* `elastic+kill0`: the same with process 0 (rank 0: before, it hosted the coordination
  service, and its death ended the run; now the service runs in a process of its own);
* `elastic+hang`: process 1 SIGSTOPs itself before step --kill_at; the others are stuck in
  the next sync until the collective timeout, then evict it (declared dead by its missing
  heartbeat; its vote missing at the progress deadline) and train on; it is resumed
  (SIGCONT) once --restart_at is committed, ends itself, and is restarted and healed;
* `checkpoint+kill`: an ordinary run with checkpoints every --checkpoint_every steps;
  process 2 is SIGKILLed before step --kill_at, every process then aborts (JAX's
  heartbeat), and the run is started again and resumes from the newest checkpoint (what
  any of the faults above costs without elastic training: a hung process is declared dead
  by its heartbeat, or hangs the run until someone kills it).

For each elastic fault it also reports the time from the fault (the faulty process logs
the moment) to the next round a survivor committed.

Each scenario runs --repeats times (interleaved, so a change in the machine's load hits all
of them alike) and reports its median. Prints a table and writes `goodput.json` to
--workdir. Wall times depend on the machine's load; the ratios are the result.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from absl import app
from absl import flags

_PROCESSES = flags.DEFINE_integer("processes", 3, "Processes (islands), one device each.")
_STEPS = flags.DEFINE_integer("steps", 1500, "Training steps.")
_ALGO = flags.DEFINE_string("algo", "diloco", "Method (a name of experiments/methods/).")
_SYNC_EVERY = flags.DEFINE_integer("sync_every", 10, "H of the local-update methods.")
_KILL_AT = flags.DEFINE_integer("kill_at", 600, "Process 2 is SIGKILLed before this step.")
_RESTART_AT = flags.DEFINE_integer("restart_at", 610, "Elastic: restart it once process 0 "
                                   "has committed this step.")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 250,
                                         "Checkpoint interval of the checkpoint runs.")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout", 5, "Seconds to declare a process dead.")
_COLLECTIVE_TIMEOUT = flags.DEFINE_integer("collective_timeout", 30,
                                           "Elastic: CPU collective timeout, seconds.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/goodput", "Where the runs and goodput.json go.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Runs of each scenario (the median is kept).")
_SCENARIOS = flags.DEFINE_list(
    "scenarios", ["plain", "elastic", "elastic+kill", "elastic+kill0", "elastic+hang",
                  "checkpoint+kill"], "Scenarios to run (plain first: the reference).")

# The experiment, as experiments/train.py config overrides.
PROGRAM = {"model.name": "mlp", "data.name": "digits", "optimizer.name": "momentum",
           "optimizer.lr": 0.05, "data.batch_size": 24, "log_every": 10}
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def launch(workdir: str, schedule: list[str], checkpoint_every: int) -> tuple[float, int, str]:
  """One launch_local run: (wall seconds, exit status, stderr)."""
  n = _PROCESSES.value
  cmd = [sys.executable, "-m", "experiments.launch_local", f"--processes={n}",
         f"--devices={n}", f"--heartbeat_timeout={_HEARTBEAT.value}",
         f"--collective_timeout={_COLLECTIVE_TIMEOUT.value}", "--grace=10", *schedule, "--",
         f"--config={CONFIGS}/default.py:{_ALGO.value}",
         *[f"--config.{k}={v}" for k, v in PROGRAM.items()],
         *([f"--config.method.sync_every={_SYNC_EVERY.value}"]
           if _ALGO.value in ("diloco", "local_sgd", "sparseloco", "streaming_diloco") else []),
         f"--config.steps={_STEPS.value}", f"--config.checkpoint_every={checkpoint_every}",
         f"--workdir={workdir}"]
  began = time.perf_counter()
  result = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  return time.perf_counter() - began, result.returncode, result.stderr


def recovery(stderr: str) -> float | None:
  """A survivor's logged recovery time (failed round's start to the next commit), if any."""
  found = re.findall(r"process \d: recovered in ([0-9.]+) s", stderr)
  return float(found[0]) if found else None


def fault_to_commit(stderr: str) -> float | None:
  """Seconds from the fault (as the faulty process logged it) to the first commit after a
  discarded round (as a survivor logged it)."""
  fault = re.findall(r"elastic_run: (?:kill|stop|hang) before step \d+ \[t=([0-9.]+)\]", stderr)
  back = [float(t) for t in re.findall(r"recovered in [0-9.]+ s .*\[t=([0-9.]+)\]", stderr)]
  if not fault:
    return None
  after = [t for t in back if t > float(fault[0])]
  return min(after) - float(fault[0]) if after else None


def scenario(name: str, launches: list[tuple[list[str], int]]) -> dict:
  """Runs the launches in one fresh workdir; the last must succeed."""
  workdir = os.path.join(_WORKDIR.value, name)
  shutil.rmtree(workdir, ignore_errors=True)
  seconds, codes, logs = 0.0, [], ""
  for schedule, checkpoint_every in launches:
    s, code, log = launch(workdir, schedule, checkpoint_every)
    seconds, logs = seconds + s, logs + log
    codes.append(code)
  if codes[-1] != 0:
    raise RuntimeError(f"{name}: the last launch failed ({codes}):\n{logs[-4000:]}")
  joined = re.findall(r"process \d: joined at step (\d+)", logs)
  row = {"scenario": name, "seconds": seconds, "exit_codes": codes,
         "steps_per_second": _STEPS.value / seconds, "recovery_s": recovery(logs),
         "fault_to_commit_s": fault_to_commit(logs),
         "rejoined_at": int(joined[0]) if joined else None}
  summary = os.path.join(workdir, "elastic.json")
  if os.path.exists(summary):
    with open(summary, encoding="utf-8") as f:
      elastic = json.load(f)
    row.update(failed_rounds=elastic["failed_rounds"], steps_redone=elastic["steps_redone"])
  return row


def main(argv):
  del argv
  at, back = _KILL_AT.value, _RESTART_AT.value
  kill = [f"--kill=2@{at}"]
  scenarios = {
      "plain": [(["--noelastic"], 0)],
      "elastic": [(["--elastic"], 0)],
      "elastic+kill": [(kill + [f"--restart=2@{back}"], 0)],
      "elastic+kill0": [([f"--kill=0@{at}", f"--restart=0@{back}"], 0)],
      "elastic+hang": [([f"--stop=1@{at}", f"--cont=1@{back}", f"--restart=1@{back}"], 0)],
      "checkpoint+kill": [(["--noelastic"] + kill, _CHECKPOINT_EVERY.value),
                          (["--noelastic"], _CHECKPOINT_EVERY.value)],
  }
  scenarios = {k: v for k, v in scenarios.items() if k in _SCENARIOS.value}
  runs = {name: [] for name in scenarios}
  for _ in range(_REPEATS.value):
    for name, launches in scenarios.items():
      runs[name].append(scenario(name, launches))
  rows = [sorted(r, key=lambda row: row["seconds"])[len(r) // 2] for r in runs.values()]
  base = rows[0]["steps_per_second"]
  restart = {r["scenario"]: r for r in rows}.get("checkpoint+kill")
  for row in rows:
    row["goodput_vs_plain"] = row["steps_per_second"] / base
    row["goodput_vs_restart"] = (row["steps_per_second"] / restart["steps_per_second"]
                                 if restart else None)
    row["all_seconds"] = [r["seconds"] for r in runs[row["scenario"]]]
  os.makedirs(_WORKDIR.value, exist_ok=True)
  setup = {"processes": _PROCESSES.value, "steps": _STEPS.value, "algo": _ALGO.value,
           "sync_every": _SYNC_EVERY.value, "kill_at": _KILL_AT.value,
           "restart_at": _RESTART_AT.value, "checkpoint_every": _CHECKPOINT_EVERY.value,
           "heartbeat_timeout": _HEARTBEAT.value, "repeats": _REPEATS.value,
           "collective_timeout": _COLLECTIVE_TIMEOUT.value, "load_average": os.getloadavg()}
  with open(os.path.join(_WORKDIR.value, "goodput.json"), "w", encoding="utf-8") as f:
    json.dump({"setup": setup, "rows": rows}, f, indent=1)
  print(f"{_PROCESSES.value} processes x 1 CPU device, {_ALGO.value} H={_SYNC_EVERY.value}, "
        f"{_STEPS.value} steps, kill before step {_KILL_AT.value}; median of "
        f"{_REPEATS.value}; load average {os.getloadavg()[0]:.1f}")
  print(f"{'scenario':<16} {'wall s':>7} {'steps/s':>8} {'vs plain':>9} {'vs restart':>10} "
        f"{'recovery s':>11} {'fault->commit s':>15} {'rejoined at':>12} {'all wall s':>11}")
  num = lambda x, f=".1f": "" if x is None else format(x, f)
  for row in rows:
    back = "" if row["rejoined_at"] is None else f"step {row['rejoined_at']}"
    every = ",".join(f"{x:.0f}" for x in row["all_seconds"])
    print(f"{row['scenario']:<16} {row['seconds']:7.1f} {row['steps_per_second']:8.2f} "
          f"{row['goodput_vs_plain']:9.2f} {num(row['goodput_vs_restart'], '.2f'):>10} "
          f"{num(row['recovery_s']):>11} {num(row['fault_to_commit_s']):>15} {back:>12} "
          f"{every:>11}")


if __name__ == "__main__":
  app.run(main)
