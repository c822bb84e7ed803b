"""Starting a multi-process run whose processes may die and come back, process 0 too.

JAX's defaults make processes share fate: the coordination service tells every process to
abort when one stops sending heartbeats, and it runs inside process 0, so process 0's death
ends the run. `start_distributed` turns the first off (`jax_enable_recoverability`), joins
a coordination service that runs in a process of its own (`python -m
jaxcomm.elastic.coordinator`, which `experiments.launch_local --elastic` starts), and
bounds how long a cross-process collective may wait for a peer
(`--xla_cpu_collective_timeout_seconds`): without that bound a gloo all-reduce whose peer
was SIGKILLed never returns, the survivors never reach the next membership barrier, and a
SIGTERM then only starts JAX's preemption sync, which times out ("Preemption sync barrier
failed: DEADLINE_EXCEEDED: Barrier timed out. Id: PREEMPTION_SYNC_BARRIER::0").

With the service outside the workers, every worker is alike: any may die and be replaced,
and none has to outlive the others at exit (with recoverability on, JAX's shutdown barrier
no longer orders the exits; with the service in process 0, a process that exited after it
aborted with "Failed to disconnect from coordination service").
"""

from __future__ import annotations

import logging
import os

import jax
from jax._src import xla_bridge

from jaxcomm import _validate as v
from jaxcomm.elastic import _service

logger = logging.getLogger(__name__)

TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


def start_distributed(coordinator: str | None = None, num_processes: int | None = None,
                      process_id: int | None = None, *, heartbeat_timeout_s: int = 10,
                      collective_timeout_s: int = 30, init_timeout_s: int = 300) -> bool:
  """Joins a multi-process run in which processes may die and (re)join.

  Call it first thing, before any JAX computation, instead of
  `jaxcomm.train.start_distributed`. The coordination service must already run in a
  process of its own (`python -m jaxcomm.elastic.coordinator --address=host:port
  --num_processes=N`); every worker, process 0 included, only connects to it. A process
  that is restarted calls it again with its old `process_id`.

  Args:
    coordinator: 'host:port' of the coordination service (None: a single process).
    num_processes: the number of processes (islands) the run was started with.
    process_id: this process's index.
    heartbeat_timeout_s: how long this process waits for the service's answers before it
      gives up on it (the service's own heartbeat timeout, set where it starts, decides
      when a silent worker is declared dead). Give both the same value: a process that
      did not run for longer (SIGSTOPped) takes itself for declared dead and exits with
      `jaxcomm.elastic.EVICTED` when it resumes, before JAX's client aborts it.
    collective_timeout_s: how long a cross-process collective waits for a peer before it
      fails (XLA:CPU; bounds how long survivors stay stuck in an all-reduce with a dead
      peer). Longer than any stall of a live process (a compile, a slow step).
    init_timeout_s: how long to wait for every process to join at start-up.

  Returns:
    True if this is a multi-process run.

  >>> start_distributed()  # no coordinator: one process, nothing to do
  False
  """
  heartbeat_timeout_s = v.integer("heartbeat_timeout_s", heartbeat_timeout_s, low=1)
  collective_timeout_s = v.integer("collective_timeout_s", collective_timeout_s, low=1)
  if coordinator is None:
    return False
  num_processes = v.integer("num_processes", num_processes, low=1)
  process_id = v.integer("process_id", process_id, low=0, high=num_processes - 1)
  if xla_bridge.backends_are_initialized():
    raise RuntimeError("jaxcomm.elastic.start_distributed must run before any JAX "
                       "computation (the collective timeout is read when the backend starts).")
  flags = os.environ.get("XLA_FLAGS", "")
  if TIMEOUT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {TIMEOUT_FLAG}={collective_timeout_s}".strip()
  jax.config.update("jax_enable_recoverability", True)
  _service.connect(coordinator, num_processes, process_id,
                   heartbeat_timeout_s=heartbeat_timeout_s, init_timeout_s=init_timeout_s)
  logger.info("elastic: process %d of %d", jax.process_index(), jax.process_count())
  return True
