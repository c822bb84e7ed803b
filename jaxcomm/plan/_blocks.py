"""A stack of identical blocks planned at 1 and 2 blocks, extrapolated to any number.

A transformer of L identical blocks compiles to a program whose every per-block quantity
repeats: each block's collectives (a ZeRO-3 gather of its weights, a reduce-scatter of its
gradients) appear once more per block, a collective that XLA combines across blocks (one
all-reduce of every gradient) grows by the block's bytes, and FLOPs, bytes accessed, the
state's bytes and the bytes the counters count at each step are affine in L. So the plans at
L = 1 and L = 2 determine the one at any L (`extrapolate`), for two small compiles instead of
one the size of the model.

Collectives are matched between the two plans by kind (op, dtype, mesh axes, group size,
loop trips, and for a conditional one which of the program's branches it is in, by order of
first appearance) and by operand bytes and shape within a kind:

* bytes and shape present in both plans, more often in the second: the extra copies are
  per block (L - 1 of each at L blocks);
* present in one plan only: a combined collective that grew; its bytes at L are affine
  (the first plan's plus L - 1 times the growth), its operands the first plan's plus L - 1
  times the operands it gained.

A program that does not decompose so (a combiner that splits at some size, a schedule whose
sync steps move with L) raises `NotAffine`; plan the full model then. The tests hold an
extrapolated plan equal to a full plan of the same stack.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import numpy as np

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.plan._compile import Memory
from jaxcomm.plan._compile import StepPlan


class NotAffine(ValueError):
  """The two plans do not extrapolate (see the module docstring); plan the full model."""


def _branches(report: comm.CollectiveReport) -> dict:
  """{branch name: its index by order of first appearance} of the conditional collectives."""
  out: dict = {}
  for c in report:
    if c.in_conditional and c.branch not in out:
      out[c.branch] = len(out)
  return out


def _kind(c: comm.Collective, branches: dict) -> tuple:
  return (c.op, c.dtype, c.axes, c.group_size, c.in_conditional, c.trips,
          branches.get(c.branch, -1) if c.in_conditional else -1)


def _size(c: comm.Collective) -> tuple:
  return (c.operand_bytes, c.shape)


def _affine_shape(a: tuple, b: tuple, k: int) -> tuple | None:
  """One operand's shape at 1 + k blocks from 1 (`a`) and 2 (`b`): dimension by dimension."""
  if len(a) != len(b):
    return None
  out = tuple(x + k * (y - x) for x, y in zip(a, b))
  return out if all(n >= 0 for n in out) else None


def _grown_shape(a: tuple, b: tuple, k: int) -> tuple | None:
  """A combined collective's operand shapes at 1 + k blocks from 1 (`a`) and 2 (`b`): one
  shape grown dimension by dimension, or a tuple of operands: those of `a` kept, those that
  changed grown, and those gained repeated k times (None: no such decomposition)."""
  if not a or not b or isinstance(a[0], int) != isinstance(b[0], int):
    return None
  if isinstance(a[0], int):
    return _affine_shape(a, b, k)
  left = collections.Counter(b)
  left.subtract(collections.Counter(a))
  removed = []
  for s in a:
    if left[s] < 0:
      removed.append(s)
      left[s] += 1
  out = []
  for s in b:
    if left[s] <= 0:
      out.append(s)  # also in `a`
      continue
    left[s] -= 1
    match = next((r for r in removed if _affine_shape(r, s, k) is not None
                  and sum(x != y for x, y in zip(r, s)) == 1), None)
    if match is not None:
      removed.remove(match)
      out.append(_affine_shape(match, s, k))
    else:
      out.extend([s] * k)  # gained per block
  return tuple(out) if not removed else None


def _grown(a: comm.Collective, b: comm.Collective, blocks: int) -> comm.Collective:
  """A combined collective at `blocks` from itself at 1 (`a`) and 2 (`b`) blocks."""
  k = blocks - 1
  shape = _grown_shape(a.shape, b.shape, k)
  if shape is None:
    raise NotAffine(f"{b.op} over {b.axes}: its operands {a.shape} at 1 block and {b.shape} "
                    "at 2 do not grow by a block's")
  return dataclasses.replace(b, shape=shape, operand_bytes=_affine(a.operand_bytes,
                                                                  b.operand_bytes, blocks),
                             wire_bytes=_affine(a.wire_bytes, b.wire_bytes, blocks))


def _report(one: comm.CollectiveReport, two: comm.CollectiveReport,
            blocks: int) -> comm.CollectiveReport:
  b1, b2 = _branches(one), _branches(two)
  if len(b1) != len(b2):
    raise NotAffine(f"{len(b1)} conditional branches at 1 block, {len(b2)} at 2")
  first = collections.defaultdict(collections.Counter)
  for c in one:
    first[_kind(c, b1)][_size(c)] += 1
  second = collections.defaultdict(collections.Counter)
  for c in two:
    second[_kind(c, b2)][_size(c)] += 1
  grown: dict = {}  # id of a collective of `two` -> its extrapolation
  for kind in set(first) | set(second):
    n1, n2 = first[kind], second[kind]
    before = sorted((s for s in n1 for _ in range(max(n1[s] - n2.get(s, 0), 0))),
                    key=lambda s: s[0])
    after = sorted((s for s in n2 if s not in n1 for _ in range(n2[s])), key=lambda s: s[0])
    if len(before) != len(after):
      raise NotAffine(f"collectives {kind[:4]}: {len(before)} changed at 1 block against "
                      f"{len(after)} at 2")
    olds = {s: [c for c in one if _kind(c, b1) == kind and _size(c) == s] for s in before}
    news = {s: [c for c in two if _kind(c, b2) == kind and _size(c) == s] for s in after}
    for s1, s2 in zip(before, after):
      a, b = olds[s1].pop(), news[s2].pop(0)
      grown[id(b)] = _grown(a, b, blocks)
  out, seen = [], collections.Counter()
  for c in two:
    if id(c) in grown:
      out.append(grown[id(c)])
      continue
    kind, size = _kind(c, b2), _size(c)
    seen[(kind, size)] += 1
    base = first[kind].get(size, 0)
    out.extend([c] * (1 if seen[(kind, size)] <= base else blocks - 1))
  return comm.CollectiveReport(tuple(out))


def _affine(a: float, b: float, blocks: int) -> float:
  return a + (blocks - 1) * (b - a)


def _counted(one: StepPlan, two: StepPlan, blocks: int) -> np.ndarray | None:
  if one.counted is None or two.counted is None:
    if (one.counted is None) != (two.counted is None):
      raise NotAffine("the counters ran at one block count and not at the other")
    return None
  base1 = one.report.wire_bytes(conditional=False)
  base2 = two.report.wire_bytes(conditional=False)
  if not np.array_equal(one.counted > base1 + 0.5, two.counted > base2 + 0.5):
    raise NotAffine("the steps that sync differ between 1 and 2 blocks")
  return one.counted + (blocks - 1) * (two.counted - one.counted)


def extrapolate(one: StepPlan, two: StepPlan, blocks: int) -> StepPlan:
  """The plan of a stack of `blocks` identical blocks from its plans at 1 and 2 blocks.

  Args:
    one: the step planned with 1 block (`compile_step`).
    two: the same step with 2 blocks (same mesh, method and planned steps).
    blocks: the number of blocks to extrapolate to (>= 1).

  Returns:
    A `StepPlan`: collectives, FLOPs, bytes accessed, state bytes and counted bytes per step
    exact where the program is affine in the block count (module docstring); XLA's memory
    analysis extrapolated the same way (an estimate: a compiler's buffer reuse need not be
    affine).

  Raises:
    NotAffine: the plans do not decompose into fixed, per-block and growing parts.

  >>> import numpy as np
  >>> from jaxcomm import comm
  >>> def plan_of(blocks):  # a per-block gather and one all-reduce of every gradient
  ...   gather = comm.Collective("all-gather", "f32", (64,), ("fsdp",), 8, 256, 1792, False, 1, "g")
  ...   sum_ = comm.Collective("all-reduce", "f32", (100 + 64 * blocks,), ("replica",), 2,
  ...                          4 * (100 + 64 * blocks), 4 * (100 + 64 * blocks), False, 1, "s")
  ...   report = comm.CollectiveReport((gather,) * blocks + (sum_,))
  ...   return StepPlan(report, Memory(0, 0, 0, 0), 1e9 * blocks, 0.0, {}, None, "",
  ...                   {"replica": 2, "fsdp": 8}, 10)
  >>> twelve = extrapolate(plan_of(1), plan_of(2), 12)
  >>> len(twelve.report), twelve.flops, twelve.report == plan_of(12).report
  (13, 12000000000.0, True)
  """
  v.instance("one", one, StepPlan, "plan.StepPlan")
  v.instance("two", two, StepPlan, "plan.StepPlan")
  blocks = v.integer("blocks", blocks, low=1)
  if one.mesh_shape != two.mesh_shape or one.steps != two.steps:
    raise ValueError("one and two must be planned on the same mesh for the same steps, got "
                     f"{one.mesh_shape} / {two.mesh_shape} and {one.steps} / {two.steps}.")
  memory = Memory(*(int(round(_affine(getattr(one.memory, f), getattr(two.memory, f), blocks)))
                    for f in ("arguments", "outputs", "aliased", "temp")))
  return StepPlan(
      report=_report(one.report, two.report, blocks), memory=memory,
      flops=_affine(one.flops, two.flops, blocks),
      bytes_accessed=_affine(one.bytes_accessed, two.bytes_accessed, blocks),
      state_bytes={k: int(_affine(one.state_bytes[k], two.state_bytes[k], blocks))
                   for k in two.state_bytes},
      counted=_counted(one, two, blocks), why_not_counted=two.why_not_counted,
      mesh_shape=dict(two.mesh_shape), steps=two.steps)


def plan_stack(plan_at: Callable[[int], StepPlan], blocks: int) -> StepPlan:
  """`extrapolate(plan_at(1), plan_at(2), blocks)`: a stack planned from two small compiles.

  Args:
    plan_at: the step planned with a given number of blocks (e.g. a model config with
      `num_layers` set, built and passed to `compile_step`).
    blocks: the stack's real number of blocks.

  >>> from jaxcomm import comm
  >>> plan_at = lambda n: StepPlan(comm.CollectiveReport(()), Memory(n, n, 0, n), 3.0 * n,
  ...                              0.0, {}, None, "", {"data": 8}, 4)
  >>> plan_stack(plan_at, 22).flops
  66.0
  """
  blocks = v.integer("blocks", blocks, low=1)
  if blocks <= 2:
    return plan_at(blocks)
  return extrapolate(plan_at(1), plan_at(2), blocks)
