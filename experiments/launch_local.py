r"""Starts N local processes of a jaxcomm program as one multi-host run on 127.0.0.1.

  python -m experiments.launch_local --processes=2 -- --model=mlp --steps=100 --workdir=runs/mp

Every process gets `--coordinator=127.0.0.1:<free port> --num_processes=N --process_id=i`
and `--devices=<devices / N>` emulated CPU devices, and talks to the others through JAX's
coordination service and gloo collectives over TCP: multi-host code, tested on one machine.
The flags after `--` go to the program (`experiments.train` by default, or any module or
`.py` script given by --program that accepts the same four flags).

Faults: when a process fails, the others abort by themselves within the heartbeat timeout
(see `jaxcomm.train.start_distributed`); the launcher waits that long plus --grace seconds
and then kills whatever is left, so it never hangs. It exits with the first failing
process's status and prints one line `launch_local: {json}` with every process's exit
status and how long after the first failure each one ended.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from absl import app
from absl import flags

_PROCESSES = flags.DEFINE_integer("processes", 2, "Number of processes.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices in total (split evenly).")
_PROGRAM = flags.DEFINE_string("program", "experiments.train",
                               "Module (run with -m) or .py script to start.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout", 30, "Seconds after which a silent process is declared dead.")
_GRACE = flags.DEFINE_float(
    "grace", 15.0, "Extra seconds the others get to exit by themselves after a failure.")


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def commands(program: str, program_flags: list[str], processes: int, devices: int,
             heartbeat_timeout: int, port: int) -> list[list[str]]:
  """The command line of each process."""
  start = [sys.executable, program] if program.endswith(".py") else [sys.executable, "-m",
                                                                       program]
  return [start + list(program_flags) + [
      f"--coordinator=127.0.0.1:{port}", f"--num_processes={processes}", f"--process_id={i}",
      f"--devices={devices // processes}", f"--heartbeat_timeout={heartbeat_timeout}"]
          for i in range(processes)]


def supervise(procs: list[subprocess.Popen], deadline_after_failure: float) -> dict:
  """Waits for every process; after the first failure, kills those still alive at the deadline.

  Returns {"returncodes": [...], "failed": index of the first failure or None,
  "exit_after_failure_s": [seconds after the first failure each process ended (None if
  before)], "killed_by_launcher": [...]}.
  """
  ended_at = [None] * len(procs)
  failed, failed_at, killed = None, None, []
  while any(t is None for t in ended_at):
    now = time.monotonic()
    for i, p in enumerate(procs):
      if ended_at[i] is None and p.poll() is not None:
        ended_at[i] = now
        if p.returncode != 0 and failed is None:
          failed, failed_at = i, now
    if failed_at is not None and now - failed_at > deadline_after_failure:
      for i, p in enumerate(procs):
        if ended_at[i] is None:
          p.kill()
          p.wait()
          ended_at[i] = time.monotonic()
          killed.append(i)
    time.sleep(0.05)
  after = [None if failed_at is None or t < failed_at else round(t - failed_at, 2)
           for t in ended_at]
  return {"returncodes": [p.returncode for p in procs], "failed": failed,
          "exit_after_failure_s": after, "killed_by_launcher": killed}


def main(argv):
  program_flags = argv[1:]
  n = _PROCESSES.value
  if n < 1 or _DEVICES.value % n:
    raise app.UsageError(f"--devices ({_DEVICES.value}) must be a positive multiple of "
                         f"--processes ({n}).")
  cmds = commands(_PROGRAM.value, program_flags, n, _DEVICES.value, _HEARTBEAT.value,
                  free_port())
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  procs = [subprocess.Popen(c, env=env) for c in cmds]
  try:
    report = supervise(procs, _HEARTBEAT.value + _GRACE.value)
  finally:  # Interrupted (Ctrl-C, SIGTERM): take the children down too.
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
  for i, code in enumerate(report["returncodes"]):
    if code != 0:
      why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
      after = report["exit_after_failure_s"][i]
      when = "" if i == report["failed"] or after is None else f", {after} s after process " \
          f"{report['failed']} failed"
      print(f"launch_local: process {i} ended with {why}{when}"
            f"{' (killed by the launcher)' if i in report['killed_by_launcher'] else ''}.",
            file=sys.stderr)
  print("launch_local: " + json.dumps(report), file=sys.stderr, flush=True)
  if report["failed"] is not None:
    code = report["returncodes"][report["failed"]]
    sys.exit(code if code > 0 else 128 - code)


if __name__ == "__main__":
  app.run(main)
