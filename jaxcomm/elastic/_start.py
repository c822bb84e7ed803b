"""Starting a multi-process run whose processes may die and come back.

JAX's defaults make processes share fate: the coordination service tells every process to
abort when one stops sending heartbeats. `start_distributed` turns that off
(`jax_enable_recoverability`) and bounds how long a cross-process collective may wait for a
peer (`--xla_cpu_collective_timeout_seconds`): without that bound a gloo all-reduce whose
peer was SIGKILLed never returns, the survivors never reach the next membership barrier,
and a SIGTERM then only starts JAX's preemption sync, which times out ("Preemption sync
barrier failed: DEADLINE_EXCEEDED: Barrier timed out. Id: PREEMPTION_SYNC_BARRIER::0").

What still takes everything down: process 0 hosts the coordination service; when it dies
the others abort ("Failed to send RPC to coordination service. Either the leader task was
preempted/died/restarted unexpectedly"). And with recoverability on, JAX's shutdown barrier
no longer orders the exits: a process that exits while process 0 is already gone aborts in
its own shutdown ("Failed to disconnect from coordination service"), so process 0 waits at
exit until the others have disconnected.
"""

from __future__ import annotations

import atexit
import logging
import os
import time

import jax

from jaxcomm import _validate as v
from jaxcomm import train
from jaxcomm.elastic import _membership

logger = logging.getLogger(__name__)

TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


def start_distributed(coordinator: str | None = None, num_processes: int | None = None,
                      process_id: int | None = None, *, heartbeat_timeout_s: int = 10,
                      collective_timeout_s: int = 30, init_timeout_s: int = 300) -> bool:
  """Joins a multi-process run in which processes may die and (re)join.

  Call it first thing, before any JAX computation, instead of
  `jaxcomm.train.start_distributed` (same arguments, same environments). A process that is
  restarted calls it again with its old `process_id`.

  Args:
    coordinator: 'host:port' of process 0's coordination service (None: from the
      environment, or a single process).
    num_processes: the number of processes (islands) the run was started with.
    process_id: this process's index.
    heartbeat_timeout_s: a process silent for this long is declared dead; the others
      continue without it.
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
  if coordinator is None and not train.multi_process_environment():
    return train.start_distributed(coordinator, num_processes, process_id,
                                   heartbeat_timeout_s=heartbeat_timeout_s,
                                   init_timeout_s=init_timeout_s)
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  if xla_bridge.backends_are_initialized():
    raise RuntimeError("jaxcomm.elastic.start_distributed must run before any JAX "
                       "computation (the collective timeout is read when the backend starts).")
  flags = os.environ.get("XLA_FLAGS", "")
  if TIMEOUT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {TIMEOUT_FLAG}={collective_timeout_s}".strip()
  jax.config.update("jax_enable_recoverability", True)
  started = train.start_distributed(coordinator, num_processes, process_id,
                                    heartbeat_timeout_s=heartbeat_timeout_s,
                                    init_timeout_s=init_timeout_s)
  if started and jax.process_index() == 0:
    atexit.register(_outlive_the_others)
  return started


def _outlive_the_others() -> None:
  """At process 0's exit: returns once every other process has disconnected (or died)."""
  client = _membership.client()
  if client is None:
    return
  try:
    # A barrier of the live processes. It returns when the others have disconnected (at
    # their exit) or died, or when one of them meets it from a membership round: a process
    # that was still joining, which now reads that the run is over and exits; wait again.
    while set(client.get_live_nodes(list(range(jax.process_count())))) != {0}:
      time.sleep(0.05)
  except jax.errors.JaxRuntimeError as e:  # nothing left to protect
    logger.warning("waiting for the other processes to exit: %s", e)
