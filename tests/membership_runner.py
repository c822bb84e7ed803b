r"""Rounds of `jaxcomm.elastic`'s membership alone (no training): the agreement, fast.

  python tests/membership_runner.py <coordinator> <process> <processes> <hang_at>

Each process joins the run, then takes rounds of one step (an empty body) until step 10,
printing `committed T live [...]` after each; from step 8 on, all `processes` must be live
(`min_workers`). The process with the highest index hangs (sleeps) in the round from step
`hang_at` (-1: never) right after the decision, before JAX's membership barrier: a process
that voted and still heartbeats, which the others must not wait for. Started again, it
rejoins as a new member.
"""

from __future__ import annotations

import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxcomm import elastic  # noqa: E402

STEPS = 10


def main(coordinator: str, pid: int, n: int, hang_at: int) -> None:
  jax.config.update("jax_num_cpu_devices", 1)
  elastic.start_distributed(coordinator, n, pid, heartbeat_timeout_s=3)
  quorum = elastic.Quorum(min_workers=lambda t: n if t >= 8 else 1, timeout_s=60)
  membership = elastic.Membership(timeout_s=30, quorum=quorum, deadline_s=2)
  if pid == n - 1:
    arrive = membership._arrive

    def hang_then_arrive(base):
      if membership.step == hang_at:
        print(f"runner: process {pid} hangs after its vote", file=sys.stderr, flush=True)
        time.sleep(3600)
      arrive(base)

    membership._arrive = hang_then_arrive
  step = 0
  while step < STEPS:
    try:
      with membership.round(step, step + 1) as gen:
        pass
    except (elastic.RoundAborted, jax.errors.JaxRuntimeError,
            multihost_utils.ProcessFailureError):
      if not membership.decided:
        membership.failed()
        continue
    if gen is None:  # waiting for a quorum
      continue
    step = membership.step + 1  # a joiner's first round starts where the run is
    membership.committed(0.01)
    print(f"runner: process {pid}: committed {step} live {list(gen.processes)}",
          file=sys.stderr, flush=True)
  membership.finish(step)
  membership.close()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
