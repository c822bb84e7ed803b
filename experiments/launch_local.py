r"""Starts N local processes of a jaxcomm program as one multi-host run on 127.0.0.1.

  python -m experiments.launch_local --processes=2 -- --config.model.name=mlp \
      --config.data.name=digits --config.steps=100 --workdir=runs/mp

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

Elastic runs (`jaxcomm.elastic`): with --elastic, or a failure schedule, the processes do
not share fate; the others train on when one dies or hangs, process 0 included: the
launcher first starts JAX's coordination service in a process of its own (`python -m
jaxcomm.elastic.coordinator`), which it stops at the end (--noelastic --kill=... kills a
process of an ordinary run, which then fails as a whole).

  python -m experiments.launch_local --processes=3 --devices=3 --heartbeat_timeout=5 \\
      --kill=2@40 --restart=2@80 \\
      -- --config=experiments/configs/diloco.py --config.method.sync_every=10 \\
      --config.model.name=mlp --config.data.name=digits --config.data.batch_size=24 \\
      --config.steps=400 --workdir=runs/elastic

--kill=P@T arms process P to SIGKILL itself when it is about to take step T (exactly then,
so runs are reproducible); --hang=P@T to hang there (its main thread sleeps, its
heartbeats go on); --stop=P@T to SIGSTOP itself then, and --cont=P@T sends it
SIGCONT once a live process has committed step T; --restart=P@T starts P again, with the
same command line, once P is dead and a live process has committed step T; --partition=
0+1|2+3@T splits the processes' view of each other from step T. Each takes a
comma-separated list (--partition one spec). The program gets elastic mode and its
failure detection as settings (`--config.elastic.enabled=True`,
`--config.elastic.heartbeat_timeout_s`, `--config.elastic.collective_timeout_s`), its
faults as `--fault=kill@T` (first incarnation only), and `--progress_file`, where it writes
each step it commits. The run ends once every process has ended (after the first one that
finished, the others get --grace seconds); the launcher exits with status 0 when every
process's last incarnation exited 0, or, for a process on the kill or stop schedule, ended
by SIGKILL, SIGABRT or eviction (the schedule's, or the launcher's when it was restarted
too late to join); otherwise with the first other status.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl import flags

from . import _cli

EVICTED = 75  # exit status of a process the others evicted (jaxcomm.elastic.EVICTED)

# The flags exist only when this module runs as a program: importing it (tests do)
# registers nothing that could clash with another program's flags.
if __name__ == "__main__":
  _PROCESSES = flags.DEFINE_integer("processes", 2, "Number of processes.")
  _DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices in total (split evenly).",
                                  lower_bound=1)
  _PROGRAM = flags.DEFINE_string("program", f"{__package__}.train",
                                 "Module (run with -m) or .py script to start.")
  _HEARTBEAT = flags.DEFINE_integer(
      "heartbeat_timeout", 30, "Seconds after which a silent process is declared dead.")
  _GRACE = flags.DEFINE_float(
      "grace", 15.0, "Extra seconds the others get to exit by themselves after a failure.")
  _ELASTIC = flags.DEFINE_bool(
      "elastic", None, "Processes do not share fate (jaxcomm.elastic); on by default with "
      "--kill or --restart (--noelastic: a kill brings every process down, as without it).")
  _KILL = flags.DEFINE_list("kill", [], "P@T,...: process P SIGKILLs itself before step T.")
  _STOP = flags.DEFINE_list("stop", [], "P@T,...: process P SIGSTOPs itself before step T.")
  _HANG = flags.DEFINE_list("hang", [], "P@T,...: process P's main thread hangs before step T "
                            "(its heartbeats go on).")
  _CONT = flags.DEFINE_list("cont", [], "P@T,...: SIGCONT process P once a live process has "
                            "committed step T.")
  _RESTART = flags.DEFINE_list(
      "restart", [], "P@T,...: start process P again once it is dead and a live process has "
      "committed step T.")
  _PARTITION = flags.DEFINE_string(
      "partition", None, "G|G@T (G: processes joined by +, e.g. 0+1|2+3@10): from step T "
      "each group sees only its own processes (a fault hook in the membership layer).")
  _COLLECTIVE_TIMEOUT = flags.DEFINE_integer(
      "collective_timeout", 30, "Elastic runs: seconds a cross-process collective waits for a "
      "peer before it fails (XLA:CPU).")


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


def schedule(name: str, specs: list[str], processes: int) -> list[tuple[int, int]]:
  """[(process, step), ...] from `P@T` strings; ValueError naming the flag otherwise.

  >>> schedule("kill", ["2@40", "0@7"], 3)
  [(2, 40), (0, 7)]
  """
  out = []
  for spec in specs:
    try:
      p, t = (int(x) for x in spec.split("@"))
    except ValueError:
      raise ValueError(f"--{name}: expected P@T (process@step), got {spec!r}.") from None
    if not 0 <= p < processes or t < 0:
      raise ValueError(f"--{name}: process must be in [0, {processes}) and step >= 0; got "
                       f"{spec!r}.")
    out.append((p, t))
  return out


def fault_flags(i: int, faults: dict, first: bool = True, partition: str | None = None
                ) -> list[str]:
  """The program's `--fault` flags for process i: {kind: [(process, step), ...]}; kills
  and stops arm only a process's first incarnation; a partition reaches every process.

  >>> fault_flags(2, {"kill": [(2, 40)], "stop": [(1, 9)]})
  ['--fault=kill@40']
  """
  out = [f"--fault={kind}@{min(t for p, t in specs if p == i)}"
         for kind, specs in faults.items() if first and any(p == i for p, _ in specs)]
  return out + ([f"--fault=partition={partition}"] if partition else [])


def elastic_flags(i: int, progress_dir: str, heartbeat_timeout: int,
                  collective_timeout: int) -> list[str]:
  """The settings that make process i's program elastic (config.elastic) and its
  progress file."""
  return ["--config.elastic.enabled=True",
          f"--config.elastic.heartbeat_timeout_s={heartbeat_timeout}",
          f"--config.elastic.collective_timeout_s={collective_timeout}",
          f"--progress_file={os.path.join(progress_dir, f'progress.{i}')}"]


def read_progress(path: str) -> int:
  """The last step a process reported committing (-1 before any)."""
  try:
    with open(path, encoding="utf-8") as f:
      return int(f.read().strip() or -1)
  except (OSError, ValueError):
    return -1


def supervise_elastic(start, n: int, restarts: list[tuple[int, int]], progress_dir: str,
                      grace_s: float, conts: list[tuple[int, int]] = ()) -> dict:
  """Runs an elastic job: restarts and resumes processes on schedule; ends once every
  process has ended (the others get `grace_s` after the first that finished with 0).

  `start(i, first)` starts incarnation `first` (True for the first) of process i. Returns
  {"returncodes": [each process's last status], "incarnations": [[statuses], ...],
  "restarted": [[process, step], ...], "not_restarted": [...], "continued": [...],
  "killed_by_launcher": [...]}.
  """
  procs = [start(i, True) for i in range(n)]
  history = [[] for _ in range(n)]
  pending, waking = list(restarts), list(conts)
  restarted, continued, killed = [], [], []
  finished = None  # when the first process ended with status 0 (the run is over)
  while any(p is not None for p in procs):
    for i, p in enumerate(procs):
      if p is not None and p.poll() is not None:
        history[i].append(p.returncode)
        procs[i] = None
        if p.returncode == 0 and finished is None:
          finished = time.monotonic()
    if finished is not None and time.monotonic() - finished > grace_s:
      for i, p in enumerate(procs):
        if p is not None:
          p.kill()
          p.wait()
          history[i].append(p.returncode)
          procs[i] = None
          killed.append(i)
      break
    committed = max(read_progress(os.path.join(progress_dir, f"progress.{i}"))
                    for i in range(n))
    for item in list(waking):
      i, step = item
      if procs[i] is not None and committed >= step:
        procs[i].send_signal(signal.SIGCONT)
        continued.append([i, step])
        waking.remove(item)
    for item in list(pending):
      i, step = item
      if procs[i] is None and history[i] and committed >= step and finished is None:
        procs[i] = start(i, False)
        restarted.append([i, step])
        pending.remove(item)
    time.sleep(0.05)
  return {"returncodes": [h[-1] if h else None for h in history], "incarnations": history,
          "restarted": restarted, "not_restarted": [list(x) for x in pending],
          "continued": continued, "killed_by_launcher": killed}


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


def start_coordinator(port: int, processes: int, heartbeat_timeout: int) -> subprocess.Popen:
  """JAX's coordination service in a process of its own (no worker hosts it)."""
  return subprocess.Popen([sys.executable, "-m", "jaxcomm.elastic.coordinator",
                           f"--address=127.0.0.1:{port}", f"--num_processes={processes}",
                           f"--heartbeat_timeout={heartbeat_timeout}"])


def main_elastic(cmds: list[list[str]], env: dict, port: int) -> None:
  n = len(cmds)
  try:
    faults = {"kill": schedule("kill", _KILL.value, n), "stop": schedule("stop", _STOP.value, n),
              "hang": schedule("hang", _HANG.value, n)}
    restarts = schedule("restart", _RESTART.value, n)
    conts = schedule("cont", _CONT.value, n)
  except ValueError as e:
    raise ValueError(str(e)) from None
  with tempfile.TemporaryDirectory(prefix="launch_local_") as progress_dir:
    live = [start_coordinator(port, n, _HEARTBEAT.value)]

    def start(i, first):
      extra = elastic_flags(i, progress_dir, _HEARTBEAT.value, _COLLECTIVE_TIMEOUT.value)
      proc = subprocess.Popen(cmds[i] + extra + fault_flags(i, faults, first, _PARTITION.value),
                              env=env)
      live.append(proc)
      return proc

    try:
      report = supervise_elastic(start, n, restarts, progress_dir, _GRACE.value, conts)
    finally:  # Also when interrupted (Ctrl-C, SIGTERM): take the children down too.
      for p in live[1:]:
        if p.poll() is None:
          p.send_signal(signal.SIGCONT)
          p.send_signal(signal.SIGTERM)
      live[0].send_signal(signal.SIGTERM)  # the coordination service, last
      try:
        live[0].wait(timeout=10)
      except subprocess.TimeoutExpired:
        live[0].kill()
        live[0].wait()
  print("launch_local: " + json.dumps(report), file=sys.stderr, flush=True)
  faulty = {p for specs in faults.values() for p, _ in specs}
  bad = [c for i, c in enumerate(report["returncodes"])
         if c != 0 and not (i in faulty and c in (-signal.SIGKILL, -signal.SIGABRT, EVICTED))]
  if bad:
    sys.exit(bad[0] if bad[0] > 0 else 128 - bad[0])


def main(argv):
  program_flags = argv[1:]
  n = _PROCESSES.value
  if n < 1 or _DEVICES.value % n:
    raise ValueError(f"--devices ({_DEVICES.value}) must be a positive multiple of "
                         f"--processes ({n}).")
  port = free_port()
  cmds = commands(_PROGRAM.value, program_flags, n, _DEVICES.value, _HEARTBEAT.value, port)
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  faulty = _KILL.value or _RESTART.value or _STOP.value or _HANG.value or _PARTITION.value
  elastic = _ELASTIC.value if _ELASTIC.value is not None else bool(faulty)
  if elastic:
    main_elastic(cmds, env, port)
    return
  try:
    kills = schedule("kill", _KILL.value, n)
  except ValueError as e:
    raise ValueError(str(e)) from None
  if _RESTART.value or _STOP.value or _HANG.value or _PARTITION.value:
    raise ValueError("--restart, --stop, --hang and --partition need an elastic run "
                         "(drop --noelastic).")
  procs = [subprocess.Popen(c + fault_flags(i, {"kill": kills}), env=env)
           for i, c in enumerate(cmds)]
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
  _cli.run(main)  # a mistake in a flag is one line, not the usage
