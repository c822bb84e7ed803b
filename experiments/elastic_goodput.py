r"""Goodput under a failure: elastic training against restarting everything from a checkpoint.

  python -m experiments.elastic_goodput --config.repeats=2 --workdir=runs/goodput

Runs the same multi-process experiment (experiments/train.py through launch_local, one
device per process, on loopback) four ways, one after the other, and reports the useful
steps per second of each (the run's steps over its wall time, start-up and compiles
included) and its ratio to the ordinary run without failures:

* `plain`: an ordinary run, no failure (the reference);
* `elastic`: the same with `jaxcomm.elastic`, no failure (what membership rounds cost);
* `elastic+kill`: process 2 is SIGKILLed before step `kill_at` and restarted once a live
  process has committed `restart_at`; the others train on and heal it when it is back;
* `elastic+kill0`: the same with process 0 (rank 0: before, it hosted the coordination
  service, and its death ended the run; now the service runs in a process of its own);
* `elastic+hang`: process 1 SIGSTOPs itself before step `kill_at`; the others are stuck in
  the next sync until the collective timeout, then evict it (declared dead by its missing
  heartbeat; its vote missing at the progress deadline) and train on; it is resumed
  (SIGCONT) once `restart_at` is committed, ends itself, and is restarted and healed;
* `checkpoint+kill`: an ordinary run with checkpoints every `checkpoint_every` steps;
  process 2 is SIGKILLed before step `kill_at`, every process then aborts (JAX's
  heartbeat), and the run is started again and resumes from the newest checkpoint (what
  any of the faults above costs without elastic training: a hung process is declared dead
  by its heartbeat, or hangs the run until someone kills it).

For each elastic fault it also reports the time from the fault (the faulty process logs
the moment) to the next round a survivor committed.

Each scenario runs `repeats` times (interleaved, so a change in the machine's load hits all
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

import ml_collections
from absl import flags

from . import _cli
from . import toolkit

SCENARIOS = ("plain", "elastic", "elastic+kill", "elastic+kill0", "elastic+hang",
             "checkpoint+kill")


def get_config() -> ml_collections.ConfigDict:
  """The experiment's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      processes=3,              # processes (islands), one device each
      steps=1500,               # training steps
      algo="diloco",            # method (a name of experiments/methods/)
      sync_every=10,            # H of the local-update methods
      kill_at=600,              # process 2 is SIGKILLed before this step
      restart_at=610,           # elastic: restart it once process 0 has committed this step
      checkpoint_every=250,     # checkpoint interval of the checkpoint runs
      heartbeat_timeout=5,      # seconds to declare a process dead
      collective_timeout=30,    # elastic: CPU collective timeout, seconds
      repeats=1,                # runs of each scenario (the median is kept)
      scenarios=",".join(SCENARIOS)))  # scenarios to run (plain first: the reference)


def check(c) -> list:
  """The settings, checked (ValueError naming the first out of range); the scenarios."""
  for name in ("processes", "steps", "sync_every", "kill_at", "restart_at",
               "checkpoint_every", "heartbeat_timeout", "collective_timeout", "repeats"):
    toolkit.int_at_least(c, name, 1)
  return toolkit.names_in(c, "scenarios", SCENARIOS)

# The experiment, as experiments/train.py config overrides.
PROGRAM = {"model.name": "mlp", "data.name": "digits", "optimizer.name": "momentum",
           "optimizer.lr": 0.05, "data.batch_size": 24, "log_every": 10}
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def launch(c, workdir: str, schedule: list[str],
           checkpoint_every: int) -> tuple[float, int, str]:
  """One launch_local run of settings `c`: (wall seconds, exit status, stderr)."""
  n = c.processes
  cmd = [sys.executable, "-m", f"{__package__}.launch_local", f"--processes={n}",
         f"--devices={n}", f"--heartbeat_timeout={c.heartbeat_timeout}",
         f"--collective_timeout={c.collective_timeout}", "--grace=10", *schedule, "--",
         f"--config={CONFIGS}/default.py:{c.algo}",
         *[f"--config.{k}={v}" for k, v in PROGRAM.items()],
         *([f"--config.method.sync_every={c.sync_every}"]
           if c.algo in ("diloco", "local_sgd", "sparseloco", "streaming_diloco") else []),
         f"--config.steps={c.steps}", f"--config.checkpoint_every={checkpoint_every}",
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


def scenario(c, name: str, launches: list[tuple[list[str], int]]) -> dict:
  """Runs the launches in one fresh workdir; the last must succeed."""
  workdir = os.path.join(flags.FLAGS.workdir, name)
  shutil.rmtree(workdir, ignore_errors=True)
  seconds, codes, logs = 0.0, [], ""
  for schedule, checkpoint_every in launches:
    s, code, log = launch(c, workdir, schedule, checkpoint_every)
    seconds, logs = seconds + s, logs + log
    codes.append(code)
  if codes[-1] != 0:
    raise RuntimeError(f"{name}: the last launch failed ({codes}):\n{logs[-4000:]}")
  joined = re.findall(r"process \d: joined at step (\d+)", logs)
  row = {"scenario": name, "seconds": seconds, "exit_codes": codes,
         "steps_per_second": c.steps / seconds, "recovery_s": recovery(logs),
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
  c = flags.FLAGS.config
  chosen = check(c)
  at, back = c.kill_at, c.restart_at
  kill = [f"--kill=2@{at}"]
  scenarios = {
      "plain": [(["--noelastic"], 0)],
      "elastic": [(["--elastic"], 0)],
      "elastic+kill": [(kill + [f"--restart=2@{back}"], 0)],
      "elastic+kill0": [([f"--kill=0@{at}", f"--restart=0@{back}"], 0)],
      "elastic+hang": [([f"--stop=1@{at}", f"--cont=1@{back}", f"--restart=1@{back}"], 0)],
      "checkpoint+kill": [(["--noelastic"] + kill, c.checkpoint_every),
                          (["--noelastic"], c.checkpoint_every)],
  }
  scenarios = {k: v for k, v in scenarios.items() if k in chosen}
  runs = {name: [] for name in scenarios}
  for _ in range(c.repeats):
    for name, launches in scenarios.items():
      runs[name].append(scenario(c, name, launches))
  rows = [sorted(r, key=lambda row: row["seconds"])[len(r) // 2] for r in runs.values()]
  base = rows[0]["steps_per_second"]
  restart = {r["scenario"]: r for r in rows}.get("checkpoint+kill")
  for row in rows:
    row["goodput_vs_plain"] = row["steps_per_second"] / base
    row["goodput_vs_restart"] = (row["steps_per_second"] / restart["steps_per_second"]
                                 if restart else None)
    row["all_seconds"] = [r["seconds"] for r in runs[row["scenario"]]]
  os.makedirs(flags.FLAGS.workdir, exist_ok=True)
  setup = {"processes": c.processes, "steps": c.steps, "algo": c.algo,
           "sync_every": c.sync_every, "kill_at": c.kill_at,
           "restart_at": c.restart_at, "checkpoint_every": c.checkpoint_every,
           "heartbeat_timeout": c.heartbeat_timeout, "repeats": c.repeats,
           "collective_timeout": c.collective_timeout, "load_average": os.getloadavg()}
  with open(os.path.join(flags.FLAGS.workdir, "goodput.json"), "w", encoding="utf-8") as f:
    json.dump({"setup": setup, "rows": rows}, f, indent=1)
  print(f"{c.processes} processes x 1 CPU device, {c.algo} H={c.sync_every}, "
        f"{c.steps} steps, kill before step {c.kill_at}; median of "
        f"{c.repeats}; load average {os.getloadavg()[0]:.1f}")
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
  _cli.run(main, get_config(), workdir="runs/goodput")
