"""Quorum rules of an elastic run: when may a set of live processes train on?

torchft settled these after incidents; each rule has a reason:

* `min_workers`: fewer processes than this may not train (a run too small to be worth
  its cost, or whose batch would be too small). They wait for others to join.
* `majority`: a new quorum must hold a strict majority of the last committed one. A
  network partition leaves each side believing the other dead; without this rule both
  sides would train on and the run would split into two models. With it, at most one side
  (the larger) goes on. (With two processes, losing either one stops the run.)
* `timeout_s`: how long processes below quorum wait before stopping with `QuorumLost`
  (a clear message and exit status instead of training alone or hanging).
* `join_window_s`: when processes join, the others wait this long (one empty round) before
  forming the next generation, so a burst of restarts forms one quorum instead of many
  (each new generation costs a new mesh and its compiles).
* `shrink_only`: between checkpoints a generation may lose processes but not gain them:
  joiners are admitted only at a round that starts at a checkpoint step, so that every
  checkpoint is taken by a quorum that ran the whole period since the previous one (long
  outer steps are not disturbed mid-way by heals).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from jaxcomm import _validate as v


class QuorumLost(RuntimeError):
  """The live processes could not form a valid quorum within the quorum timeout."""


class Quorum(NamedTuple):
  """The quorum rules (see the module docstring for the reason of each).

  >>> q = Quorum(min_workers=3)
  >>> for why in q.violations(live=(0, 1), last=(0, 1, 2, 3), step=0):
  ...   print(why)
  2 live processes, fewer than min_workers = 3
  live [0, 1] is not a strict majority of the last quorum [0, 1, 2, 3]
  >>> q.violations(live=(0, 1, 2), last=(0, 1, 2, 3), step=0)
  []
  """
  min_workers: int | Callable[[int], int] = 1
  majority: bool = True
  timeout_s: float = 60.0
  join_window_s: float = 0.0
  shrink_only: bool = False

  def check(self) -> "Quorum":
    """Self, after checking the settings (ValueError naming the first bad one)."""
    if not callable(self.min_workers):
      v.integer("min_workers", self.min_workers, low=1)
    v.number("timeout_s", self.timeout_s, low=0)
    v.number("join_window_s", self.join_window_s, low=0)
    return self

  def minimum(self, step: int) -> int:
    return self.min_workers(step) if callable(self.min_workers) else self.min_workers

  def violations(self, live: Sequence[int], last: Sequence[int], step: int) -> list[str]:
    """Why `live` (processes) may not train at `step` after the quorum `last` ([]: it may)."""
    out = []
    if len(live) < self.minimum(step):
      out.append(f"{len(live)} live processes, fewer than min_workers = "
                 f"{self.minimum(step)}")
    kept = [p for p in live if p in last]
    if self.majority and last and not 2 * len(kept) > len(last):
      out.append(f"live {sorted(live)} is not a strict majority of the last quorum "
                 f"{sorted(last)}")
    return out
