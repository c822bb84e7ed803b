"""JAX's coordination service in a process of its own, and workers that only connect to it.

`jax.distributed.initialize` starts the coordination (distributed runtime) service inside
the process with `process_id == 0` and has no switch to start it elsewhere; when that
process dies, every other process loses the service and aborts. JAX 0.10's public API
offers no other way; the pieces it is built from do: `get_distributed_runtime_service`
(the service alone, no devices, no client) and `get_distributed_runtime_client` (a
worker's connection). `serve` runs the first in a process that does no training
(`python -m jaxcomm.elastic.coordinator`); `connect` does what `jax.distributed.initialize`
does on a worker, minus starting the service, so process 0 becomes a worker like the
others: it may die and be replaced. Both use JAX's internal module `jax._src.distributed`
(the same objects `jax.distributed` fills in), the one private dependency of this package.
"""

from __future__ import annotations

import logging

import jax
from jax._src import distributed
from jax._src.lib import _jax

logger = logging.getLogger(__name__)

GLOBAL_TOPOLOGY = "cpu:global_topology/cpu"
_connected = {}  # what `connect` joined with (one connection per process, like JAX's own)


def connected_heartbeat_timeout() -> int | None:
  """The heartbeat timeout `connect` joined with (None: not connected through it)."""
  return _connected.get("heartbeat_timeout_s")


def serve(address: str, num_processes: int, *, heartbeat_timeout_s: int,
          shutdown_timeout_s: int = 30):
  """Starts the coordination service for `num_processes` workers on `address` (host:port).

  Returns the service; it runs until `.shutdown()` or the end of the process. Recoverable:
  a worker that dies is dropped from the live set instead of ending the job.
  """
  logger.info("coordination service for %d processes on %s", num_processes, address)
  return _jax.get_distributed_runtime_service(
      address, num_processes, heartbeat_timeout=heartbeat_timeout_s,
      shutdown_timeout=shutdown_timeout_s, recoverable=True)


def connect(coordinator: str, num_processes: int, process_id: int, *,
            heartbeat_timeout_s: int, init_timeout_s: int = 300) -> None:
  """Joins the service at `coordinator` as worker `process_id`, starting no service.

  Fills in `jax.distributed`'s global state exactly as `jax.distributed.initialize` does
  for a process other than 0, so the backend, `live_devices` and the key-value store work
  as usual.
  """
  state = distributed.global_state
  if state.client is not None:
    raise RuntimeError("jax.distributed is already initialised in this process.")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  state.coordinator_address = coordinator
  state.process_id = process_id
  state.num_processes = num_processes
  state.client = _jax.get_distributed_runtime_client(
      coordinator, process_id, init_timeout=init_timeout_s, use_compression=True,
      heartbeat_timeout=heartbeat_timeout_s)
  state.client.connect()
  _connected["heartbeat_timeout_s"] = heartbeat_timeout_s
  if process_id == 0:
    # XLA's CPU client has node 0 write the global device topology to the key-value store,
    # create-only, when its backend starts; a process 0 that restarts into a running job
    # would fail on it ("ALREADY_EXISTS: key cpu:global_topology/cpu already exists"). It
    # writes the same topology again (the others read it once, at their start).
    state.client.key_value_delete(GLOBAL_TOPOLOGY)
  state.initialize_preemption_sync_manager()
