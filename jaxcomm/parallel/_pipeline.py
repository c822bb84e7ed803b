"""Pipeline parallelism: GPipe and 1F1B schedules over a `pipeline` mesh axis.

A schedule is a static table: at every time step, what each stage does (forward of
micro-batch m, backward of micro-batch m, or nothing), built by list-scheduling each
stage's op order under the pipeline's data dependencies with unit-time ops. One executor
runs any table under `jax.shard_map`: each device is one stage; after each step the stage
outputs travel to the next stage and the input gradients to the previous one by ppermute.

Stages keep only their *boundary* activations (the input of the stage for each micro-batch
in flight) and recompute the stage in the backward step, as GPipe does. GPipe runs all
forwards, then all backwards: every stage holds M activations. 1F1B (PipeDream-Flush)
starts backwards as soon as the last stage can, so stage s holds at most S-s of them
awaiting their backward (plus, here, one that arrived before the stage could take it): never
more than S, whatever M. Both have the same bubble with unit-time ops, (S-1)/(M+S-1).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import comm

#: What a pipeline stage does at a tick of a schedule: nothing, a forward or a backward pass.
IDLE, FORWARD, BACKWARD = 0, 1, 2


class PipelineSchedule(NamedTuple):
  """A static pipeline schedule (see `schedule_gpipe`, `schedule_1f1b`)."""
  name: str
  num_stages: int          # S
  num_microbatches: int    # M
  actions: np.ndarray      # i32[steps, S, 2]: (IDLE|FORWARD|BACKWARD, micro-batch) per stage
  live: np.ndarray         # i32[S]: peak boundary activations held by each stage
  act_slots: int           # activation buffer slots per stage (micro-batch m uses m % slots)
  grad_slots: int          # received-gradient buffer slots per stage

  @property
  def steps(self) -> int:
    return self.actions.shape[0]

  @property
  def bubble_fraction(self) -> float:
    """Idle fraction of the stage-steps of the table."""
    return float(np.mean(self.actions[..., 0] == IDLE))


def bubble_fraction_gpipe(num_stages: int, num_microbatches: int) -> float:
  """(S-1)/(M+S-1), the GPipe bubble with equal-time stages (arXiv 1811.06965).

  Example:
    >>> bubble_fraction_gpipe(4, 12)  # 3 idle slots out of 15
    0.2
  """
  return (num_stages - 1) / (num_microbatches + num_stages - 1)


def _check(num_stages, num_microbatches):
  v.integer("num_stages", num_stages, low=1)
  v.integer("num_microbatches", num_microbatches, low=1)
  if num_microbatches < num_stages:
    raise ValueError(f"num_microbatches ({num_microbatches}) must be >= num_stages "
                     f"({num_stages}): fewer micro-batches than stages leaves stages idle.")


def _list_schedule(orders, num_stages):
  """Runs each stage's op list in order, each op at the first step its inputs are ready."""
  done = {}  # (kind, stage, m) -> step it ran
  pos = [0] * num_stages
  rows = []
  for t in itertools.count():
    if all(p == len(o) for p, o in zip(pos, orders)):
      break
    row = []
    for s in range(num_stages):
      if pos[s] == len(orders[s]):
        row.append((IDLE, 0))
        continue
      kind, m = orders[s][pos[s]]
      deps = [(FORWARD, s - 1, m)] if kind == FORWARD and s > 0 else []
      if kind == BACKWARD:
        deps = [(FORWARD, s, m)] + ([(BACKWARD, s + 1, m)] if s < num_stages - 1 else [])
      if all(done.get(d, t) < t for d in deps):
        row.append((kind, m))
      else:
        row.append((IDLE, 0))
    for s, (kind, m) in enumerate(row):
      if kind != IDLE:
        done[(kind, s, m)] = t
        pos[s] += 1
    rows.append(row)
    if t > 4 * sum(len(o) for o in orders):
      raise RuntimeError("pipeline schedule deadlocked.")
  return np.asarray(rows, np.int32), done


def _slots(intervals) -> int:
  """Fewest slots k such that entries m -> m % k never overwrite a live entry.

  An entry (m, a, b) is written at the end of step a and last read at step b.
  """
  n = max((m for m, _, _ in intervals), default=0) + 1
  for k in range(1, n + 1):
    if all(m1 % k != m2 % k or a2 >= b1 or a1 >= b2
           for (m1, a1, b1), (m2, a2, b2) in itertools.combinations(intervals, 2)):
      return k
  return n


def _build(name, orders, num_stages, num_microbatches) -> PipelineSchedule:
  actions, done = _list_schedule(orders, num_stages)
  s_count, ms = num_stages, range(num_microbatches)
  # A stage holds micro-batch m's input from its arrival until its backward.
  arrive = lambda s, m: done[(FORWARD, s - 1, m)] if s else done[(FORWARD, 0, m)] - 1
  act = [[(m, arrive(s, m), done[(BACKWARD, s, m)]) for m in ms] for s in range(s_count)]
  grad = [[(m, done[(BACKWARD, s + 1, m)], done[(BACKWARD, s, m)]) for m in ms]
          for s in range(s_count - 1)]
  steps = actions.shape[0]
  live = np.array([max(sum(a < t <= b for _, a, b in iv) for t in range(steps)) for iv in act],
                  np.int32)
  return PipelineSchedule(
      name=name, num_stages=num_stages, num_microbatches=num_microbatches, actions=actions,
      live=live, act_slots=max(_slots(iv) for iv in act),
      grad_slots=max([_slots(iv) for iv in grad] or [1]))


def schedule_gpipe(num_stages: int, num_microbatches: int) -> PipelineSchedule:
  """GPipe: every stage runs the M forwards, then the M backwards (last micro-batch first).

  Args:
    num_stages: S, the size of the pipeline axis.
    num_microbatches: M >= S.

  Returns:
    The schedule; 2(M+S-1) steps, bubble (S-1)/(M+S-1), M activations per stage.

  References:
    Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
    Parallelism", arXiv 1811.06965.

  >>> sched = schedule_gpipe(4, 8)
  >>> sched.steps, round(sched.bubble_fraction, 4), sched.live.tolist()
  (22, 0.2727, [8, 8, 8, 8])
  """
  _check(num_stages, num_microbatches)
  order = ([(FORWARD, m) for m in range(num_microbatches)] +
           [(BACKWARD, m) for m in reversed(range(num_microbatches))])
  return _build("gpipe", [order] * num_stages, num_stages, num_microbatches)


def schedule_1f1b(num_stages: int, num_microbatches: int) -> PipelineSchedule:
  """1F1B (PipeDream-Flush): S-1-s warm-up forwards, then alternate forward and backward.

  Args:
    num_stages: S, the size of the pipeline axis.
    num_microbatches: M >= S.

  Returns:
    The schedule; same bubble as GPipe, but stage s holds at most S-s activations
    awaiting their backward (+1 received early): at most S, independent of M.

  References:
    Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-2BW /
    Flush), arXiv 2006.09503; Narayanan et al., "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473.

  >>> sched = schedule_1f1b(4, 8)
  >>> sched.steps, round(sched.bubble_fraction, 4), sched.live.tolist()
  (22, 0.2727, [4, 4, 3, 2])
  """
  _check(num_stages, num_microbatches)
  orders = []
  for s in range(num_stages):
    warm = min(num_stages - 1 - s, num_microbatches)
    order = [(FORWARD, m) for m in range(warm)]
    for m in range(num_microbatches - warm):
      order += [(FORWARD, warm + m), (BACKWARD, m)]
    order += [(BACKWARD, m) for m in range(num_microbatches - warm, num_microbatches)]
    orders.append(order)
  return _build("1f1b", orders, num_stages, num_microbatches)


_MAX_SEGMENTS = 5  # each segment is one more traced copy of the stage: bounds compile time


def _segments(schedule: PipelineSchedule):
  """Runs of steps with the same traffic: [(start, stop, sends_fwd, sends_bwd)].

  Each run becomes one `lax.scan` whose steps ppermute only what some stage sends in it.
  Beyond `_MAX_SEGMENTS` runs, the shortest run is merged into a neighbour (sending what
  either sent), trading a few idle sends for a smaller program.
  """
  kinds = schedule.actions[..., 0]
  fwd = (kinds[:, :-1] == FORWARD).any(axis=1)   # a non-last stage sends an activation
  bwd = (kinds[:, 1:] == BACKWARD).any(axis=1)   # a non-first stage sends a gradient
  out, start = [], 0
  for t in range(1, len(kinds) + 1):
    if t == len(kinds) or (fwd[t], bwd[t]) != (fwd[start], bwd[start]):
      out.append([start, t, bool(fwd[start]), bool(bwd[start])])
      start = t
  while len(out) > _MAX_SEGMENTS:
    i = min(range(len(out)), key=lambda j: out[j][1] - out[j][0])
    j = i - 1 if i == len(out) - 1 or (i > 0 and out[i - 1][1] - out[i - 1][0] <=
                                        out[i + 1][1] - out[i + 1][0]) else i + 1
    a, b = sorted((i, j))
    out[a:b + 1] = [[out[a][0], out[b][1], out[a][2] or out[b][2], out[a][3] or out[b][3]]]
    merged = [out[0]]
    for seg in out[1:]:  # neighbours that now send the same things become one run
      if seg[2:] == merged[-1][2:]:
        merged[-1] = [merged[-1][0], seg[1], *seg[2:]]
      else:
        merged.append(seg)
    out = merged
  return [tuple(seg) for seg in out]


def pipeline_bytes(schedule: PipelineSchedule, activation_bytes: float,
                   shared_grad_bytes: float = 0.0) -> float:
  """Wire bytes per device of one `pipeline_run`: ppermutes plus the final reductions.

  Every step of a segment that moves activations (gradients) ppermutes one micro-batch's
  boundary activation forward (its gradient backward) on every device; then the loss
  (f32[]) and the gradients of the parameters shared by all stages are all-reduced over
  the pipeline axis.

  Example:
    >>> pipeline_bytes(schedule_gpipe(4, 8), activation_bytes=1024.0)
    20486.0
  """
  s = schedule.num_stages
  permutes = sum((stop - start) * (int(f) + int(b)) for start, stop, f, b in
                 _segments(schedule))
  return (permutes * activation_bytes + comm.allreduce_bytes(4 + shared_grad_bytes, s)
          if s > 1 else 0.0)


def pipeline_run(first_fn: Callable, stage_fn: Callable, last_fn: Callable, params: Any,
                 microbatches: Any, schedule: PipelineSchedule, axis_name: str):
  """Runs a pipeline schedule on this device's stage: loss, gradients and step counts.

  Call inside `jax.shard_map` with `axis_name` manual (one device per stage). Every
  function receives this device's full parameter tree (its own stage's leaves, plus any
  leaves shared by all stages):

  * `first_fn(params, microbatch) -> x`: stage 0's input (e.g. the embedding);
  * `stage_fn(params, x) -> x`: this stage's layers (same activation shape everywhere);
  * `last_fn(params, x, microbatch) -> loss`: the last stage's scalar loss.

  Args:
    first_fn: see above.
    stage_fn: see above.
    last_fn: see above.
    params: this stage's parameters.
    microbatches: pytree of arrays with a leading micro-batch axis [M, ...].
    schedule: a `PipelineSchedule` with `num_stages` equal to the axis size.
    axis_name: the pipeline mesh axis.

  Returns:
    `(loss, grads, busy)`: the mean loss over micro-batches (invariant over the axis),
    d loss / d params (leaves not varying over the axis are summed over it), and i32[] the
    number of steps in which this stage ran a forward or a backward (a count of the table's
    slots as executed, not a time: 1 - busy / schedule.steps is the table's idle fraction).

  >>> from jax.sharding import PartitionSpec as P
  >>> from jaxcomm.parallel import make_mesh
  >>> mesh = make_mesh({"pipeline": 2, "data": 4})
  >>> def body(w, mb):  # two stages, each multiplies by its own weight
  ...   loss, _, busy = pipeline_run(
  ...       lambda p, m: m["x"], lambda p, x: x * p["w"][0],
  ...       lambda p, x, m: jnp.mean((x - m["y"]) ** 2), w, mb, schedule_gpipe(2, 2), "pipeline")
  ...   return loss, busy[None]
  >>> f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=({"w": P("pipeline")}, P()),
  ...                           out_specs=(P(), P("pipeline")), axis_names={"pipeline"}))
  >>> loss, busy = f({"w": jnp.array([2.0, 3.0])}, {"x": jnp.ones((2, 3)), "y": jnp.zeros((2, 3))})
  >>> float(loss), busy.tolist()
  (36.0, [4, 4])
  """
  s_count, m_count = schedule.num_stages, schedule.num_microbatches
  if comm.axis_size(axis_name) != s_count:
    raise ValueError(f"the schedule has {s_count} stages but axis {axis_name!r} has "
                     f"{comm.axis_size(axis_name)} devices.")
  for x in jax.tree.leaves(microbatches):
    if x.shape[0] != m_count:
      raise ValueError(f"microbatches have leading size {x.shape[0]}; the schedule expects "
                       f"num_microbatches={m_count}.")
  stage = lax.axis_index(axis_name)
  axes = tuple(frozenset().union(*(comm.varying_axes(x) for x in
                                   jax.tree.leaves((params, microbatches))), {axis_name}))
  vary = lambda tree: comm.varying(tree, axes)
  # Cast everything to varying once, here: inside a stage's backward branch the transpose
  # of an invariant->varying cast would be a psum that only some stages reach (deadlock).
  shared_params, params, microbatches = params, vary(params), vary(microbatches)
  table = jnp.asarray(schedule.actions)
  first_mb = jax.tree.map(lambda x: x[0], microbatches)
  act = jax.eval_shape(first_fn, params, first_mb)
  zeros_act = lambda: vary(jnp.zeros(act.shape, act.dtype))

  def local(p, x_in, mb):
    h = lax.cond(stage == 0, lambda: vary(first_fn(p, mb)), lambda: vary(x_in))
    y = vary(stage_fn(p, h))
    loss = lax.cond(stage == s_count - 1,
                    lambda: vary(jnp.asarray(last_fn(p, y, mb), jnp.float32)),
                    lambda: vary(jnp.zeros((), jnp.float32)))
    return y, loss

  def step(carry, t, kinds, sends_fwd, sends_bwd):
    buf, gbuf, grads, loss_sum, busy = carry
    kind, m = table[t, stage, 0], table[t, stage, 1]
    mb = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, m, keepdims=False), microbatches)
    x_in = buf[m % schedule.act_slots]

    def idle():
      return zeros_act(), zeros_act(), grads, loss_sum, busy

    def forward():
      y, _ = local(params, x_in, mb)
      return y, zeros_act(), grads, loss_sum, busy + 1

    def backward():
      (_, loss), vjp = jax.vjp(lambda p, x: local(p, x, mb), params, x_in)
      last = stage == s_count - 1
      dy = jnp.where(last, 0.0, gbuf[m % schedule.grad_slots])
      d_loss = vary(jnp.where(last, 1.0 / m_count, 0.0).astype(jnp.float32))
      d_params, dx = vjp((dy, d_loss))
      grads_new = jax.tree.map(lambda g, d: g + vary(d), grads, d_params)
      return zeros_act(), vary(dx), grads_new, loss_sum + loss, busy + 1

    # Only the kinds of op this segment contains are compiled into it.
    branches = [(idle, forward, backward)[k] for k in kinds]
    index = sum(jnp.where(kind > k, 1, 0) for k in kinds[:-1]) if len(kinds) > 1 else 0
    send_f, send_b, grads, loss_sum, busy = lax.switch(index, branches)
    if sends_fwd:  # the activation of micro-batch pm arrives from stage s-1
      recv, _ = comm.ppermute(send_f, axis_name, [(i, i + 1) for i in range(s_count - 1)])
      pk, pm = table[t, jnp.maximum(stage - 1, 0), 0], table[t, jnp.maximum(stage - 1, 0), 1]
      slot = pm % schedule.act_slots
      keep = (stage > 0) & (pk == FORWARD)
      buf = buf.at[slot].set(jnp.where(keep, recv, buf[slot]))
    if sends_bwd:  # the input gradient of micro-batch nm arrives from stage s+1
      recv, _ = comm.ppermute(send_b, axis_name, [(i, i - 1) for i in range(1, s_count)])
      nxt = jnp.minimum(stage + 1, s_count - 1)
      nk, nm = table[t, nxt, 0], table[t, nxt, 1]
      slot = nm % schedule.grad_slots
      keep = (stage < s_count - 1) & (nk == BACKWARD)
      gbuf = gbuf.at[slot].set(jnp.where(keep, recv, gbuf[slot]))
    return (buf, gbuf, grads, loss_sum, busy), None

  carry = vary((jnp.zeros((schedule.act_slots, *act.shape), act.dtype),
                jnp.zeros((schedule.grad_slots, *act.shape), act.dtype),
                jax.tree.map(jnp.zeros_like, params),
                jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)))
  for start, stop, sends_fwd, sends_bwd in _segments(schedule):
    kinds = tuple(sorted(set(schedule.actions[start:stop, :, 0].ravel().tolist())))
    carry, _ = lax.scan(lambda c, t, k=kinds, f=sends_fwd, b=sends_bwd: step(c, t, k, f, b),
                        carry, jnp.arange(start, stop))
  _, _, grads, loss_sum, busy = carry
  loss, _ = comm.sum(loss_sum, axis_name)

  def settle(g, p):
    # JAX's own rule: a gradient varying over axes its parameter does not vary over is summed.
    extra = tuple(a for a in axes if a in comm.varying_axes(g) and a not in
                  comm.varying_axes(p))
    return comm.sum(g, extra)[0] if extra else g

  grads = jax.tree.map(settle, grads, shared_params)
  return loss / m_count, grads, busy


def pipeline_loss(first_fn: Callable, stage_fn: Callable, last_fn: Callable,
                  schedule: PipelineSchedule, axis_name: str = "pipeline") -> Callable:
  """`loss(params, microbatches)` whose gradient is computed by the pipeline schedule.

  The whole schedule (forwards and backwards) runs when the loss is evaluated; its
  gradients are returned by a custom VJP, so the loss drops into `jax.grad` and the
  `Trainer` like any other. Arguments as in `pipeline_run`.

  >>> import jax.numpy as jnp
  >>> sched = schedule_1f1b(1, 2)
  >>> loss = pipeline_loss(lambda p, mb: mb * p["w"], lambda p, x: x,
  ...                      lambda p, y, mb: jnp.mean(y), sched, axis_name=None)
  >>> float(loss({"w": jnp.float32(2.0)}, jnp.ones((2, 3))))
  2.0
  """

  def run(params, microbatches):
    if axis_name is None:  # one stage, no pipeline: the reference computation
      per_mb = jax.vmap(lambda mb: last_fn(params, stage_fn(params, first_fn(params, mb)), mb))
      loss = jnp.mean(per_mb(microbatches))
      return loss, jax.grad(lambda p: jnp.mean(jax.vmap(
          lambda mb: last_fn(p, stage_fn(p, first_fn(p, mb)), mb))(microbatches)))(params)
    loss, grads, _ = pipeline_run(first_fn, stage_fn, last_fn, params, microbatches,
                                  schedule, axis_name)
    return loss, grads

  @jax.custom_vjp
  def loss_fn(params, microbatches):
    return run(params, microbatches)[0]

  def fwd(params, microbatches):
    return run(params, microbatches)

  def bwd(grads, ct):
    return jax.tree.map(lambda g: (g * ct).astype(g.dtype), grads), None

  loss_fn.defvjp(fwd, bwd)
  return loss_fn
