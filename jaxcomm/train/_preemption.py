"""SIGTERM on a single-process run: finish the step, save, stop (nothing is lost).

A preemptible machine (a spot VM, a SLURM job past its time, Kubernetes evicting a pod) gets
SIGTERM some seconds before SIGKILL. Python's default is to die at once, losing every step
since the last periodic checkpoint. While `fit` runs with a checkpointer it catches SIGTERM
instead and only notes it; the loop checks the note after each step, saves a checkpoint of
that step and returns early.

Multi-process runs are left to JAX: `jax.distributed` installs its own SIGTERM notifier and
the processes agree on the step to save at (`Checkpointer.reached_preemption`), which a
handler here would override.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

import jax


class StopRequest:
  """`requested`: whether SIGTERM arrived since `catch_sigterm` started."""

  def __init__(self):
    self.requested = False

  def note(self, signum, frame) -> None:
    """The signal handler: only notes the request (the loop logs and saves)."""
    del signum, frame
    self.requested = True


@contextlib.contextmanager
def catch_sigterm(enabled: bool = True) -> Iterator[StopRequest]:
  """Notes SIGTERM in the returned `StopRequest` instead of dying, until the block ends.

  Does nothing (the request stays False) when not `enabled`, on a multi-process run, or off
  the main thread (where Python cannot install handlers). The previous handler is restored
  on exit.
  """
  request = StopRequest()
  if (not enabled or jax.process_count() > 1
      or threading.current_thread() is not threading.main_thread()):
    yield request
    return
  previous = signal.signal(signal.SIGTERM, request.note)
  try:
    yield request
  finally:
    signal.signal(signal.SIGTERM, previous)
