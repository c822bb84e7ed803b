r"""The failure model against the real elastic runtime: a drawn schedule, replayed both ways.

  python -m experiments.failure_replay --workdir=runs/replay

1. Draws failures from the failure model (`jaxcomm.sim.draw_failures`) for processes 1..W-1
   over the run's steps at a nominal step time (process 0 is left out of the draw: the
   metrics' clock is its own), keeping those at steps where the process can still rejoin.
2. Runs experiments/train.py (DiLoCo, a round of H steps, on the digits MLP) on W processes,
   one device each, with `experiments.launch_local`: each drawn failure is a SIGKILL before
   its step, and the process is started again at once.
3. Measures the run's goodput: worker-steps committed (each round's steps times its live
   processes) over W x the wall time from the first committed round to the last, in units
   of the failure-free step time (the median step of the rounds of all live processes).
4. Simulates the same schedule (`jaxcomm.sim.simulate_failures` with the elastic semantics:
   a failure discards the round in flight on every survivor, the others go on without the
   failed process, which joins at a round boundary once back), at the kills' measured times,
   with the platform's latencies read from the same run: the step time (the median round of
   all live processes, over the whole run); `regroup_s`, the first round's extra time (a new
   mesh and its compiles, paid at every change of the live set); `restart_s`, a process's
   start-up (launch to first commit) less that; `detect_s`, the progress deadline (a
   setting): a killed process's peers learn of it when their collective fails at once
   (JAX's `ProcessFailureError`, the coordination service having seen its connection
   close), then wait the deadline for its vote; the heartbeat timeout is what a hung
   process costs, not a killed one. Process 0 must survive (its rows are the clock): a run
   in which the machine's load got it declared dead is reported as such.

Prints both goodputs and writes `replay.json` (and the run's log, `launch.log`) to --workdir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import ml_collections
from absl import flags

from jaxcomm import elastic, sim

from . import _cli
from . import toolkit

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
PROGRAM = {"model.name": "mlp", "data.name": "digits", "optimizer.name": "momentum",
           "optimizer.lr": 0.05, "data.batch_size": 24}


def get_config() -> ml_collections.ConfigDict:
  """The experiment's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      processes=3,           # processes (islands), one device each
      steps=60,              # training steps
      sync_every=5,          # DiLoCo's H: steps per elastic round
      mtbf_h=0.002,          # per-process MTBF of the drawn schedule, hours (7.2 s)
      nominal_step_s=0.1,    # step time the schedule is drawn at (steps = seconds / this)
      seed=3,                # the draw's seed
      heartbeat_timeout=5,   # seconds to declare a process dead
      deadline_s=3.0,        # progress deadline for a missing vote
      collective_timeout=10,
      grace_s=10.0))         # after the first process finished, the others' time to end


def check(c) -> None:
  """The settings, checked (ValueError naming the first out of range)."""
  for name in ("steps", "sync_every", "heartbeat_timeout", "collective_timeout"):
    toolkit.int_at_least(c, name, 1)
  toolkit.int_at_least(c, "processes", 2)
  toolkit.int_at_least(c, "seed", 0)
  for name in ("mtbf_h", "nominal_step_s", "deadline_s"):
    toolkit.number_in(c, name, 0.0, low_open=True)
  toolkit.number_in(c, "grace_s", 0.0)


def schedule(c) -> list[tuple[int, int]]:
  """[(kill step, process), ...]: the drawn failures of processes 1..W-1 at steps from the
  second round to two rounds before the end, the first of each process (launch_local arms a
  kill in a process's first incarnation only), one per round at most."""
  model = sim.failure_model(f"mtbf_h={c.mtbf_h}")
  drawn = sim.draw_failures(model, c.processes - 1, c.processes - 1,
                            c.steps * c.nominal_step_s, seed=c.seed)
  out, taken = [], set()
  for when, unit in drawn:
    step = int(when / c.nominal_step_s)
    if (c.sync_every <= step <= c.steps - 2 * c.sync_every and step // c.sync_every not in taken
        and unit + 1 not in {p for _, p in out}):
      taken.add(step // c.sync_every)
      out.append((step, unit + 1))
  return out


def launch(c, workdir: str, kills: list) -> tuple[float, str, dict]:
  """The run: (launch time, stderr, launch_local's report)."""
  faults = [f"--kill={','.join(f'{p}@{s}' for s, p in kills)}",
            f"--restart={','.join(f'{p}@{s}' for s, p in kills)}"] if kills else ["--elastic"]
  cmd = [sys.executable, "-m", f"{__package__}.launch_local", f"--processes={c.processes}",
         f"--devices={c.processes}", f"--heartbeat_timeout={c.heartbeat_timeout}",
         f"--collective_timeout={c.collective_timeout}", f"--grace={c.grace_s}", *faults, "--",
         f"--config={CONFIGS}/default.py:diloco",
         *[f"--config.{k}={v}" for k, v in PROGRAM.items()],
         f"--config.method.sync_every={c.sync_every}", f"--config.steps={c.steps}",
         f"--config.log_every={c.sync_every}", f"--config.elastic.deadline_s={c.deadline_s}",
         f"--workdir={workdir}"]
  began = time.time()
  result = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  lines = [l for l in result.stderr.splitlines() if l.startswith("launch_local: {")]
  if result.returncode or not lines:
    raise RuntimeError(f"the replay run failed ({result.returncode}):\n"
                       f"{result.stderr[-4000:]}")
  return began, result.stderr, json.loads(lines[-1][len("launch_local: "):])


def measure(c, rows: list, log: str, began: float) -> dict:
  """The measured goodput and the platform's latencies (module docstring, 3 and 4)."""
  kills = [float(t) for t in re.findall(r"elastic_run: kill before step \d+ \[t=([0-9.]+)\]",
                                        log)]
  # Process 0's relative clock (its rows) against wall time, from a commit it logged both.
  anchor = None
  for step, when in re.findall(r"process 0: recovered in [0-9.]+ s \(.*? to this commit at "
                               r"step (\d+)\); live \[[0-9, ]*\] \[t=([0-9.]+)\]", log):
    row = next(r for r in rows if r["step"] == int(step))
    anchor = float(when) - row["time"]
  full = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:])
          if len(b["live"]) == c.processes and len(a["live"]) == c.processes]
  step_s = statistics.median(full) / c.sync_every   # (the median: outages do not move it)
  regroup = rows[0]["time"] - c.sync_every * step_s
  startup = (rows[0]["time"] + anchor - began if anchor is not None else rows[0]["time"])
  work = sum(len(b["live"]) * (b["step"] - a["step"]) for a, b in zip(rows, rows[1:]))
  wall = rows[-1]["time"] - rows[0]["time"]
  return {"goodput": work * step_s / (c.processes * wall), "step_s": step_s,
          "regroup_s": regroup, "restart_s": max(0.0, startup - c.sync_every * step_s
                                                 - regroup),
          "wall_s": wall, "kills_s": [k - anchor - rows[0]["time"] for k in kills]}


def simulate(c, kills: list, measured: dict) -> float:
  """The elastic simulation of the same failures with the measured latencies."""
  model = sim.failure_model(f"restart_s={measured['restart_s']},detect_s="
                            f"{c.deadline_s},regroup_s="
                            f"{measured['regroup_s']}")
  semantics = sim.Semantics("elastic", c.processes, c.sync_every, elastic.Quorum())
  failures = [(t, p) for t, (_, p) in zip(measured["kills_s"], kills)]
  run = sim.simulate_failures(model, c.processes, semantics, measured["step_s"],
                              work_s=(c.steps - c.sync_every) * measured["step_s"],
                              failures=failures)
  return run.goodput


def main(argv):
  del argv
  c = flags.FLAGS.config
  check(c)
  kills = schedule(c)
  workdir = flags.FLAGS.workdir
  shutil.rmtree(workdir, ignore_errors=True)
  began, log, report = launch(c, workdir, kills)
  with open(os.path.join(workdir, "launch.log"), "w", encoding="utf-8") as f:
    f.write(log)
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  measured = measure(c, rows, log, began)
  simulated = simulate(c, kills, measured)
  out = {"settings": c.to_dict(), "kills": [{"step": s, "process": p} for s, p in kills],
         "measured": measured, "simulated_goodput": simulated, "launch": report}
  with open(os.path.join(workdir, "replay.json"), "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)
  print(f"kills (step@process): {', '.join(f'{s}@{p}' for s, p in kills) or 'none'}")
  print(f"platform: step {measured['step_s'] * 1e3:.1f} ms, regroup "
        f"{measured['regroup_s']:.1f} s, restart {measured['restart_s']:.1f} s")
  print(f"goodput: measured {measured['goodput']:.3f}, simulated {simulated:.3f}")


if __name__ == "__main__":
  _cli.run(main, get_config(), workdir="runs/replay")
