"""The eviction watchdog: a thread that ends this process, cleanly, once it is out of the run.

Two ways out, both with exit status `EVICTED` (75) and one log line naming the generation:

* **Evicted by the others** (its vote was missing at the progress deadline, or it did not
  reach the next membership barrier in time): they write its incarnation under
  `jaxcomm/elastic/evicted/<process>`, which the thread polls. Its main thread may hang
  where Python cannot interrupt it (a collective, a lock, an input pipeline); this thread
  still runs.
* **Declared dead by the coordination service** (the process did not run for longer than
  the heartbeat timeout: SIGSTOPped, a suspended VM, a host frozen under swap). On
  SIGCONT, JAX's client aborts the process at its next heartbeat, which the service
  answers "heartbeat request from an already-in-error task" (a C++ `LOG(FATAL)`, status
  SIGABRT). That handler (`missed_heartbeat_callback`) cannot be replaced from Python: jaxlib
  0.10 accepts a Python callable but cannot convert the `absl::Status` it is called with,
  and the process ends in `std::bad_cast`. That heartbeat came 1.0 s after the process
  resumed (two probes, heartbeat timeout 3 s); this thread ticks every 50 ms, sees the time
  it did not run, and exits first (10 ms after SIGCONT in the same probes).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable

import jax

#: The exit status of an evicted process (EX_TEMPFAIL: it may be started again).
EVICTED = 75
TICK_S = 0.05  # how often the thread wakes (its reaction time after a SIGCONT)
POLL_S = 0.2   # how often it reads its eviction key


def evicted_key(prefix: str, process: int) -> str:
  return f"{prefix}/evicted/{process}"


class Watchdog:
  """Ends this process with `EVICTED` once it is out of the run (see the module docstring).

  Args:
    client: the coordination-service client.
    key: the key the others write this process's incarnation under when they evict it.
    stall_s: a time without running longer than this means the service declared this
      process dead (its heartbeat timeout; None: not checked).
    where: `() -> (generation, step)` of the round this process is in, for the log line.
    clock: the clock it reads (tests pass a fake one).
    end: how it ends the process (tests pass a fake one).

  >>> class Store:  # nothing evicted yet
  ...   def key_value_try_get(self, key):
  ...     raise jax.errors.JaxRuntimeError("NOT_FOUND")
  >>> dog = Watchdog(Store(), "jaxcomm/elastic/evicted/0", 10.0, lambda: (0, 0))
  >>> dog.close()
  """

  def __init__(self, client, key: str, stall_s: float | None,
               where: Callable[[], tuple], clock: Callable[[], float] = time.monotonic,
               end: Callable[[int], None] = os._exit):
    self.client, self.key, self.stall_s, self.where = client, key, stall_s, where
    self.clock, self.end = clock, end
    self.incarnation = None  # set after the first membership barrier
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True, name="elastic-watchdog")
    self._thread.start()

  def _watch(self) -> None:
    last = polled = self.clock()
    while not self._stop.wait(TICK_S):
      now = self.clock()
      if self.stall_s is not None and now - last > self.stall_s:
        self._exit(f"it did not run for {now - last:.1f} s, longer than the heartbeat "
                   f"timeout ({self.stall_s} s), so the coordination service declared it "
                   f"dead", leave=False)   # already out of the live set
        return
      last = now
      if self.incarnation is not None and now - polled > POLL_S:
        polled = now
        with contextlib.suppress(jax.errors.JaxRuntimeError):  # not evicted
          if self.client.key_value_try_get(self.key) == str(self.incarnation):
            self._exit("the others evicted it (no progress within the deadline)", leave=True)
            return

  def _exit(self, why: str, leave: bool) -> None:
    generation, step = self.where()
    sys.stderr.write(f"elastic: process {jax.process_index()}: evicted at generation "
                     f"{generation} (round from step {step}): {why}; exiting with status "
                     f"{EVICTED}\n")
    sys.stderr.flush()
    if leave:
      with contextlib.suppress(Exception):
        self.client.shutdown()  # leaves the live set now, not after the heartbeat timeout
    self.end(EVICTED)

  def close(self) -> None:
    """Stops the thread (at the end of `fit`, and at exit: a daemon thread caught inside a
    call into JAX's client at exit would abort the process, "FATAL: exception not
    rethrown")."""
    self._stop.set()
    if self._thread is not threading.current_thread():
      self._thread.join(timeout=5)
