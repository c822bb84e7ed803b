r"""experiments/train.py with a kill switch and the fault tests' method settings.

  python tests/fault_runner.py <faults.flag_args("powersgd", 12)> --workdir=... --kill_at=7
  python tests/fault_runner.py <faults.flag_args("dp", 12)> --algos=dp,powersgd --workdir=...
  python tests/fault_runner.py <faults.flag_args("diloco", 12)> --workdir=... --term_at=6

Runs `experiments.train.main` unchanged (so the tests exercise the real program: config
flags, resume from --workdir, multi-host start-up, checkpoints). --algos runs several
methods one after the other in one process (one start-up, one set of processes), each in
--workdir/<algo>: the command line's config with the method's settings from
`faults.SETTINGS`.

With --kill_at=T, process --kill_process sends itself SIGKILL when it is about to take step
T, once a checkpoint of an earlier step is complete on disk (a kill "after a checkpoint";
the save of a later one may still be in flight, which must not matter). With --term_at=T it
stops before step T, says so on stderr and waits for the SIGTERM the test sends it from
outside (a preemption notice arriving mid-run).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import faults  # noqa: E402
from experiments import build  # noqa: E402
from experiments import config as experiments_config  # noqa: E402
from experiments import train  # noqa: E402

_KILL_AT = flags.DEFINE_integer("kill_at", -1, "SIGKILL this process before step N.")
_KILL_PROCESS = flags.DEFINE_integer("kill_process", 0, "Which process --kill_at kills.")
_TERM_AT = flags.DEFINE_integer("term_at", -1, "Before step N, wait for a SIGTERM from outside.")
_ALGOS = flags.DEFINE_list("algos", None, "Run these methods in turn, each in workdir/<algo>.")


def _complete_checkpoint(directory: str) -> bool:
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def _wait_for_sigterm(step: int, timeout_s: float = 60) -> None:
  """Announces step `step` on stderr and waits until SIGTERM has been handled (or timeout)."""
  received = []
  handler = signal.getsignal(signal.SIGTERM)  # fit's, which notes the request

  def observe(signum, frame):
    received.append(signum)
    if callable(handler):
      handler(signum, frame)
    else:  # no handler to note it: die of it as usual
      signal.signal(signum, handler)
      signal.raise_signal(signum)

  signal.signal(signal.SIGTERM, observe)
  print(f"fault_runner: waiting for SIGTERM at step {step}", file=sys.stderr, flush=True)
  deadline = time.monotonic() + timeout_s
  while not received and time.monotonic() < deadline:
    time.sleep(0.01)


def _with_kill_switch(build_fn):
  """`build.build` whose runs' batches first apply --term_at and --kill_at."""
  def build_killing(config, *args, **kwargs):
    import jax
    run = build_fn(config, *args, **kwargs)
    checkpoints = os.path.join(flags.FLAGS.workdir, "checkpoints")

    def batches_killing(step, batches=run.batches):
      if step == _TERM_AT.value:
        _wait_for_sigterm(step)
      if step == _KILL_AT.value and jax.process_index() == _KILL_PROCESS.value:
        deadline = time.monotonic() + (60 if config.checkpoint_every else 0)
        while not _complete_checkpoint(checkpoints) and time.monotonic() < deadline:
          time.sleep(0.05)
        print(f"fault_runner: SIGKILL at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      return batches(step)

    return dataclasses.replace(run, batches=batches_killing)

  return build_killing


def main(argv):
  if not _ALGOS.value:
    return train.main(argv)
  # Several methods in turn in one process: the command line's config (its experiment and
  # cadence) with each method's settings from faults.SETTINGS, each in workdir/<algo>.
  import jax
  jax.config.update("jax_num_cpu_devices", flags.FLAGS.devices)
  from jaxcomm import train as jaxcomm_train
  jaxcomm_train.start_distributed(flags.FLAGS.coordinator, flags.FLAGS.num_processes,
                                  flags.FLAGS.process_id,
                                  heartbeat_timeout_s=flags.FLAGS.heartbeat_timeout)
  base = flags.FLAGS.workdir
  for algo in _ALGOS.value:
    config = experiments_config.with_method(flags.FLAGS.config,
                                            {"method": algo, **faults.SETTINGS[algo]})
    flags.FLAGS.workdir = os.path.join(base, algo)
    status = train.execute(config, flags.FLAGS.workdir)
    if status:
      sys.exit(status)
  return None


if __name__ == "__main__":
  build.build = _with_kill_switch(build.build)
  app.run(main)
