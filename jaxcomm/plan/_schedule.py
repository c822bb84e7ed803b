"""The bytes a transform's counters count at each step, at the real size, without the model.

A stage adds the bytes it sends to a `wire_bytes` counter inside the branch that sends
(docs/algorithms.md, "Counted"), so the step's counted bytes say which steps sync (DiLoCo
every H steps, Streaming DiLoCo one fragment at a time, 1-bit Adam after its warm-up).
Which branch runs depends on the state's counters and keys, not on the parameters' values.
So the step is run here as a *counter machine*: the per-device scalars and every non-float
leaf of the train state are carried from step to step, and everything else (parameters,
moments, error memories, the batch) is zeros that JAX removes as dead code, because
nothing the counters need reads it. Two checks make this safe rather than hopeful:

* the step is first compiled with those leaves and the batch as arguments; if any of them
  survives dead-code elimination, the schedule depends on values and is not computed;
* the machine's compiled memory (XLA's analysis) must stay under `limit` bytes per device
  before it runs, so nothing the size of the model is ever allocated.

Counters are u32 (comm.add_bytes): a step that sends 4 GiB or more per device wraps. The
true count is then recovered from the compiled program: it is the every-step bytes plus the
bytes of some set of conditional branches (`comm.Collective.branch`), the one set whose
total agrees with the counter modulo 2**32.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import comm

LIMIT = 64 << 20   # bytes per device the counter machine may hold
_WRAP = 2 ** 32
_MAX_BRANCHES = 16  # subsets of at most this many branches are searched when unwrapping
_TOLERANCE = 1 << 20  # counted vs compiled bytes, when unwrapping: the residues are 4 GiB apart


def _carried(leaf: jax.ShapeDtypeStruct) -> bool:
  """Whether the machine carries a state leaf: every non-float leaf (counters, step counts,
  keys, masks) and every float that is a scalar on each device."""
  if not jnp.issubdtype(leaf.dtype, jnp.floating):
    return True
  shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
  return int(np.prod(shape)) <= 1


def _zeros(leaf: jax.ShapeDtypeStruct) -> jax.Array:
  return jnp.zeros(leaf.shape, leaf.dtype)


def _memory(compiled) -> int:
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def counted_bytes(program, params, state, batch, steps: int, report: comm.CollectiveReport,
                  *, limit: int = LIMIT, compiler_options: dict | None = None
                  ) -> tuple[np.ndarray | None, str]:
  """The bytes the counters count at each of the first `steps` steps from `program.init`.

  Args:
    program: the `train.Program` whose step is planned.
    params: the abstract initial parameters (what `program.init` takes).
    state: the abstract train state (`abstract_state(program, params)`).
    batch: the abstract global batch.
    steps: how many steps to count.
    report: the compiled step's collectives (to unwrap counters past 4 GiB a step).
    limit: bytes per device the counter machine may hold.
    compiler_options: XLA options of its compiles (`_compile.COMPILER_OPTIONS`).

  Returns:
    (f64[steps] bytes per device at each step, "") or (None, why not).

  DiLoCo syncing every 2nd step on 8 workers: a ring all-reduce of 1000 float32 parameters,
  2 x 7/8 x 4000 bytes per device, at steps 1 and 3.

  >>> import jax, jax.numpy as jnp, optax
  >>> from jaxcomm import local, parallel, plan, train
  >>> params = {"w": jax.ShapeDtypeStruct((1000,), jnp.float32)}
  >>> program = train.make_program(lambda p, b: jnp.sum(p["w"] * b["x"]),
  ...                              local.diloco(optax.sgd(0.1), optax.sgd(0.7), sync_every=2),
  ...                              parallel.make_mesh({"data": 8}), params)
  >>> state = plan.abstract_state(program, params)
  >>> batch = plan.abstract_batch(program, {"x": jax.ShapeDtypeStruct((8, 1000), jnp.float32)})
  >>> report = comm.inspect(program.step, state, batch)
  >>> counted_bytes(program, params, state, batch, 4, report)[0].tolist()
  [0.0, 7000.0, 0.0, 7000.0]
  """
  step_fn = program.step
  leaves, treedef = jax.tree.flatten(state)
  keep = [i for i, leaf in enumerate(leaves) if _carried(leaf)]
  rest = [i for i in range(len(leaves)) if i not in keep]

  def step(carried, others, batch_):
    full = [None] * len(leaves)
    for i, x in zip(keep, carried):
      full[i] = x
    for i, x in zip(rest, others):
      full[i] = x
    new_state, _, sent = step_fn(jax.tree.unflatten(treedef, full), batch_)
    new = jax.tree.leaves(new_state)
    return [new[i] for i in keep], sent

  carried_abs = [leaves[i] for i in keep]
  others_abs = [leaves[i] for i in rest]
  options = compiler_options or {}
  probe = jax.jit(step).lower(carried_abs, others_abs, batch).compile(compiler_options=options)
  (_, live_others, live_batch), _ = probe.input_shardings
  if jax.tree.leaves((live_others, live_batch)):
    return None, ("which steps sync depends on the parameters, optimiser moments or batch "
                  "(values the plan does not have)")

  def machine(carried):
    def body(c, _):
      return step(c, [_zeros(x) for x in others_abs],
                  jax.tree.map(_zeros, batch))
    return lax.scan(body, carried, None, length=steps)[1]

  def initial():
    return [jax.tree.leaves(program.init(jax.tree.map(_zeros, params)))[i] for i in keep]

  run = jax.jit(machine).lower(carried_abs).compile(compiler_options=options)
  start = jax.jit(initial).lower().compile(compiler_options=options)
  held = max(_memory(run), _memory(start))
  if held > limit:
    return None, (f"the counter machine would hold {held:,} bytes per device (limit "
                  f"{limit:,})")
  shardings = [x.sharding for x in carried_abs]
  carried0 = [jax.device_put(x, s) if s is not None else x for x, s in zip(start(), shardings)]
  counted = np.asarray(run(carried0), dtype=np.float64)
  return unwrap(counted, report)


def unwrap(counted: np.ndarray, report: comm.CollectiveReport) -> tuple[np.ndarray | None, str]:
  """Counts modulo 2**32 -> bytes, with the compiled program's every-step and branch bytes.

  Counts are exact while a step can send less than 4 GiB (every-step plus all conditional
  bytes); beyond, each step's count is the every-step bytes plus the set of conditional
  branches whose total agrees with it modulo 2**32.

  >>> report = comm.CollectiveReport(())
  >>> unwrap(np.array([7.0, 0.0]), report)[0].tolist()
  [7.0, 0.0]
  """
  every = report.wire_bytes(conditional=False)
  branches: dict[str, float] = {}
  for c in report.select(conditional=True):
    branches[c.branch] = branches.get(c.branch, 0.0) + c.total_bytes
  if every + sum(branches.values()) < _WRAP - _TOLERANCE:
    return counted, ""
  if len(branches) > _MAX_BRANCHES:
    return None, (f"a step may send 4 GiB or more, past the u32 counters, and "
                  f"{len(branches)} conditional branches are too many to tell apart")
  sizes = list(branches.values())
  totals = sorted({every + sum(s) for r in range(len(sizes) + 1)
                   for s in itertools.combinations(sizes, r)})
  out = np.empty_like(counted)
  for t, count in enumerate(counted):
    near = {round(total + _residue(count - total)) for total in totals
            if abs(_residue(count - total)) <= _TOLERANCE}
    if len(near) != 1:
      return None, (f"step {t}'s counted bytes ({int(count):,} modulo 2**32) match "
                    f"{'no' if not near else 'several'} sums of the compiled program's "
                    "every-step and branch bytes")
    out[t] = near.pop()
  return out, ""


def _residue(x: float) -> float:
  """x modulo 2**32, in [-2**31, 2**31)."""
  return (x + _WRAP / 2) % _WRAP - _WRAP / 2
