"""What the live processes agree on, and how: device orders, the leader's plan, the vote.

Pure bookkeeping over the coordination service's key-value store (see `_membership`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from typing import Iterator

import jax


def candidate_orders(islands: dict[int, list[int]]) -> Iterator[tuple]:
  """Device orders for a set of islands (process -> its device ids), the plainest first.

  Islands are permuted (lexicographically) and, within each permutation, every island's
  devices are rotated by the same amount; each island's devices stay contiguous.

  >>> list(candidate_orders({0: [0], 1: [5]}))
  [(0, 5), (5, 0)]
  >>> list(candidate_orders({0: [0, 1]}))
  [(0, 1), (1, 0)]
  """
  width = max(len(d) for d in islands.values())
  for rot in range(width):
    for perm in itertools.permutations(sorted(islands)):
      order = []
      for p in perm:
        devs = sorted(islands[p])
        k = rot % len(devs)
        order += devs[k:] + devs[:k]
      yield tuple(order)


class Planner:
  """The leader's bookkeeping: which processes are healed, which orders are spent.

  Every process keeps a copy; the leader's goes into each generation record (`state`), so
  any process that leads later (a healed joiner too) continues from it.

  Args:
    islands: process -> its device ids.
  """

  def __init__(self, islands: dict[int, list[int]]):
    self.islands = islands
    self.index = 0
    self.members: dict[int, int] = {}  # process -> incarnation of the last commit
    self.used: dict[tuple, tuple] = {}  # order -> the live set it was used with
    self.spent: set[tuple] = set()      # orders a failed round used

  def leader(self, live: tuple) -> int:
    """The process that plans a generation over `live`: the lowest one holding the state."""
    holders = [p for p, inc in live if not self.members or self.members.get(p) == inc]
    return min(holders) if holders else min(p for p, _ in live)

  def plan(self, live: tuple) -> dict:
    """The record of a new generation over `live` ((process, incarnation), ...)."""
    joiners = [p for p, inc in live if self.members and self.members.get(p) != inc]
    healed = [p for p, _ in live if p not in joiners]
    if not healed:
      raise RuntimeError(f"no live process holds the training state (live {live}, last "
                         f"committed members {self.members}).")
    order = self._order(live)
    self.used[order] = live
    record = {"index": self.index, "order": list(order), "joiners": joiners,
              "donor": min(healed), "leader": min(healed)}
    self.index += 1
    record["state"] = self.state()
    return record

  def state(self) -> dict:
    return {"index": self.index, "members": sorted(self.members.items()),
            "used": [[list(o), [list(x) for x in live]] for o, live in self.used.items()],
            "spent": [list(o) for o in sorted(self.spent)]}

  def load(self, state: dict) -> None:
    self.index = state["index"]
    self.members = {p: inc for p, inc in state["members"]}
    self.used = {tuple(o): tuple(tuple(x) for x in live) for o, live in state["used"]}
    self.spent = {tuple(o) for o in state["spent"]}

  def _order(self, live: tuple) -> tuple:
    islands = {p: self.islands[p] for p, _ in live}
    for order in candidate_orders(islands):
      if order not in self.spent and self.used.get(order, live) == live:
        return order
    raise RuntimeError(
        f"no unused device order left for the islands {sorted(islands)} (the CPU backend "
        f"cannot rebuild a gloo communicator: each membership change and each failed round "
        f"needs a device order never used before; give each process more devices).")

  def committed(self, live: tuple) -> None:
    self.members = dict(live)

  def failed(self, order: tuple) -> None:
    self.spent.add(order)


def decide(client, base: str, me: int, members: tuple, ok: bool, deadline_ms: int) -> dict:
  """One round's commit decision, the same on every member.

  Each member writes its vote under `base` and waits for the others' votes until
  `deadline_ms` after its own. The first member to know the outcome (every vote yes:
  commit; otherwise abort, evicting the members whose vote is still missing) writes it to
  a create-only key, and every member returns what that key says, so a member that arrives
  late follows a decision already taken.

  Returns:
    {"commit": bool, "evicted": [members whose vote was missing at the deadline]}.

  >>> class Store(dict):  # the coordination service's key-value store, create-only
  ...   def key_value_set(self, key, value):
  ...     if key in self:
  ...       raise jax.errors.JaxRuntimeError("ALREADY_EXISTS")
  ...     self[key] = value
  ...   def key_value_try_get(self, key):
  ...     if key not in self:
  ...       raise jax.errors.JaxRuntimeError("NOT_FOUND")
  ...     return self[key]
  >>> store = Store()
  >>> decide(store, "r", 0, (0,), True, 1000)
  {'commit': True, 'evicted': []}
  """
  client.key_value_set(f"{base}/vote/{me}", "1" if ok else "0")
  votes, end = {}, time.monotonic() + deadline_ms / 1000
  while True:
    with contextlib.suppress(jax.errors.JaxRuntimeError):  # someone decided already
      return json.loads(client.key_value_try_get(f"{base}/decision"))
    for p in members:
      if p not in votes:
        with contextlib.suppress(jax.errors.JaxRuntimeError):  # not in yet
          votes[p] = client.key_value_try_get(f"{base}/vote/{p}")
    if len(votes) == len(members) or time.monotonic() > end:
      break
    time.sleep(0.005)
  outcome = {"commit": all(votes.get(p) == "1" for p in members),
             "evicted": [p for p in members if p not in votes]}
  with contextlib.suppress(jax.errors.JaxRuntimeError):  # someone decided first
    client.key_value_set(f"{base}/decision", json.dumps(outcome))
  return json.loads(client.key_value_try_get(f"{base}/decision"))


def arrive(client, base: str, me: int) -> None:
  """Marks that `me` reached the membership barrier after the round `base`."""
  client.key_value_set(f"{base}/arrived/{me}", "1", allow_overwrite=True)


def missing(client, base: str, expected) -> list:
  """The processes of `expected` that have not reached the barrier after the round `base`.

  >>> class Store(dict):
  ...   def key_value_try_get(self, key):
  ...     if key not in self:
  ...       raise jax.errors.JaxRuntimeError("NOT_FOUND")
  ...     return self[key]
  >>> missing(Store({"r/arrived/0": "1"}), "r", [0, 1])
  [1]
  """
  out = []
  for p in expected:
    try:
      client.key_value_try_get(f"{base}/arrived/{p}")
    except jax.errors.JaxRuntimeError:
      out.append(p)
  return out
