"""Multi-process start-up: the same program runs on one host or on many.

`start_distributed` calls `jax.distributed.initialize` when the run is multi-process: when a
coordinator address is given, or when the environment names several processes the way JAX
reads it on SLURM, Open MPI, Cloud TPU pods / GKE (`TPU_WORKER_HOSTNAMES`,
`TPU_PROCESS_ADDRESSES`, `MEGASCALE_COORDINATOR_ADDRESS`) or through
`JAX_COORDINATOR_ADDRESS`. On a single-process run it does nothing, so programs call it
unconditionally, first thing, before any JAX computation.

After it, `jax.devices()` lists every process's devices and a mesh built with `make_mesh`
spans them; each process feeds its share of the global batch (`jaxcomm.data` batches take
`process_index`/`process_count`; `Trainer.shard_batch` assembles the global array), `fit`
writes metrics from process 0 only and `Checkpointer` writes each array once.

Failure detection (measured on loopback, see tests/test_multihost.py): every process sends
heartbeats to the coordination service, which runs in process 0.

* A process is killed: the service declares it dead after `heartbeat_timeout_s` and every
  surviving process aborts (SIGABRT) with "Terminating process because the JAX distributed
  service detected fatal errors. This most likely indicates that another task died".
* Process 0 (the service) dies: the others abort at once on the broken connection.
* A process raises: Python exits through JAX's shutdown barrier, which the others never
  reach; after `shutdown_timeout_s` the barrier fails and every process aborts.

So a run never hangs on a dead peer for longer than max(heartbeat_timeout_s,
shutdown_timeout_s) plus about a second. On CPU the cross-process collectives use gloo over
TCP.
"""

from __future__ import annotations

import logging
import os

import jax

from jaxcomm.train import _validate

logger = logging.getLogger(__name__)


def multi_process_environment() -> bool:
  """Whether the environment describes a multi-process job that JAX can join by itself."""
  env = os.environ
  if env.get("JAX_COORDINATOR_ADDRESS") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return True
  if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env:
    return int(env.get("SLURM_NTASKS", "1") or 1) > 1
  if "OMPI_MCA_orte_hnp_uri" in env:
    return int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
  hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
  return len([h for h in hosts.split(",") if h]) > 1


def start_distributed(coordinator: str | None = None, num_processes: int | None = None,
                      process_id: int | None = None, *, heartbeat_timeout_s: int = 100,
                      shutdown_timeout_s: int | None = None,
                      init_timeout_s: int = 300) -> bool:
  """Joins a multi-process run if there is one; returns whether `jax.distributed` is on.

  Args:
    coordinator: 'host:port' of process 0's coordination service; None to rely on the
      environment (see the module docstring) or run as one process.
    num_processes: the number of processes (with `coordinator`).
    process_id: this process's index in 0..num_processes-1 (with `coordinator`).
    heartbeat_timeout_s: a process that sent no heartbeat for this long is declared dead and
      every other process aborts: the bound on how long a run can hang on a killed peer.
    shutdown_timeout_s: how long an exiting process waits for the others at the shutdown
      barrier before everyone aborts (the bound when a peer exits on an exception); None
      means `heartbeat_timeout_s`. Processes of a healthy run exit within a step of each
      other.
    init_timeout_s: how long to wait for every process to join.

  Returns:
    True if this is (now) a multi-process run.

  >>> start_distributed()  # no coordinator, no cluster environment: one process
  False
  """
  if shutdown_timeout_s is None:
    shutdown_timeout_s = heartbeat_timeout_s
  _validate.distributed_args(coordinator, num_processes, process_id,
                             heartbeat_timeout_s=heartbeat_timeout_s,
                             shutdown_timeout_s=shutdown_timeout_s,
                             init_timeout_s=init_timeout_s)
  if jax.distributed.is_initialized():
    return True
  if coordinator is None and not multi_process_environment():
    return False
  # gloo is JAX's default for CPU collectives across processes; say so for CPU-only hosts.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, num_processes, process_id,
                             initialization_timeout=init_timeout_s,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             shutdown_timeout_seconds=shutdown_timeout_s)
  logger.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
  return True
