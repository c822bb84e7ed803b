"""Heterogeneous workers in SPMD: synchronous, asynchronous, Rennala and MindFlayer SGD.

Every device of the data axis is one worker with its own simulated clock; a server step is
one iteration of a `lax.scan` inside `shard_map`. The workers exchange their clocks with a
small all-gather (so every device takes the same, invariant scheduling decision) and the
gradients that count with a masked sum: worker w contributes sum_j mask_wj * g(x; xi_wj),
where the mask says which of its computations finished in time at the current iterate.
Compute times come from a `ComputeModel` and the noise of gradient j of worker w from the key
(key, w, j), so a single-device event simulation can replay a run exactly.

The result reports loss against simulated time, which gradients each step used, their
staleness, how much work was thrown away, and the bytes one device sends per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.sim._workers import ComputeModel

#: The kinds of `Method` `simulate_workers` runs (synchronous_sgd, asynchronous_sgd,
#: rennala_sgd, mindflayer_sgd).
METHODS = ("synchronous", "asynchronous", "rennala", "mindflayer")


@dataclasses.dataclass(frozen=True, eq=False)
class Method:
  """A server/worker protocol (build with the factories below)."""
  name: str
  kind: str
  batch: int = 0                      # Rennala: gradients per step
  allotted: np.ndarray | None = None  # MindFlayer: time allowed per attempt, per worker
  trials: np.ndarray | None = None    # MindFlayer: attempts per step, per worker


def synchronous_sgd() -> Method:
  """Minibatch SGD: every worker computes one gradient; the step waits for the slowest.

  >>> synchronous_sgd().kind
  'synchronous'
  """
  return Method("synchronous SGD", "synchronous")


def asynchronous_sgd() -> Method:
  """Asynchronous SGD: the server steps with each gradient as it arrives, whatever its
  staleness; the worker restarts from the new iterate (Mishchenko et al., arXiv 2206.07638).

  >>> asynchronous_sgd().kind
  'asynchronous'
  """
  return Method("asynchronous SGD", "asynchronous")


def rennala_sgd(batch: int) -> Method:
  """Rennala SGD: step after `batch` gradients computed at the current iterate.

  Workers compute continuously; a gradient that arrives after the iterate it was computed
  at has been replaced is discarded (the worker does not abort it, so a slow worker stays
  busy with stale work), and the worker restarts from the current iterate.

  References:
    Tyurin & Richtarik, Optimal time complexities of parallel stochastic optimization
    methods under a fixed computation model, NeurIPS 2023, arXiv 2305.12387.

  >>> rennala_sgd(8).batch
  8
  """
  batch = v.integer("batch", batch, low=1)
  return Method(f"Rennala SGD (B={batch})", "rennala", batch=batch)


def mindflayer_sgd(allotted, trials=1) -> Method:
  """MindFlayer SGD: worker w makes `trials[w]` attempts per step, each cut at `allotted[w]`.

  An attempt whose compute time exceeds the allotted time is abandoned and the worker
  restarts with a fresh sample; the server waits for every worker's attempts (so a step
  lasts at most max_w trials_w * allotted_w however heavy the tail) and steps with the mean
  of the gradients that finished. *(Unverified detail: the paper's normalisation may use the
  expected rather than the realised number of successes; we use the realised one and skip
  the step when none finished.)*

  Args:
    allotted: time allowed per attempt (> 0), a scalar or one per worker.
    trials: attempts per step (int >= 0), a scalar or one per worker; at least one > 0.

  References:
    Maranjyan, Omar, Richtarik, MindFlayer SGD: efficient parallel SGD in the presence of
    heterogeneous and random worker compute times, arXiv 2410.04285.

  >>> mindflayer_sgd(2.0, trials=[1, 2]).trials.tolist()
  [1, 2]
  """
  allotted = np.asarray(allotted, np.float64)
  trials_arr = np.asarray(trials)
  if allotted.ndim > 1 or not np.all(np.isfinite(allotted)) or np.any(allotted <= 0):
    raise ValueError(f"allotted must be finite and > 0 (a scalar or one per worker), "
                     f"got {allotted.tolist()}.")
  if trials_arr.ndim > 1 or not np.issubdtype(trials_arr.dtype, np.integer) or \
     np.any(trials_arr < 0) or not np.any(trials_arr > 0):
    raise ValueError(f"trials must be ints >= 0 with at least one > 0, got {trials!r}.")
  return Method("MindFlayer SGD", "mindflayer", allotted=allotted.reshape(-1).astype(np.float32),
                trials=trials_arr.reshape(-1).astype(np.int32))


class SimResult(NamedTuple):
  """What a simulated run did, step by step (K steps)."""
  method: str
  time: np.ndarray       # f64[K+1]: simulated time at which iterate k exists (time[0] = 0)
  loss: np.ndarray       # f64[K+1]: loss_fn at iterate k
  used: np.ndarray       # i32[K, W]: gradients of each worker applied at step k
  staleness: np.ndarray  # i32[K]: largest staleness (steps) among the gradients of step k
  #                        (0 by construction for the methods that use fresh gradients only)
  discarded: np.ndarray  # i32[K]: computations thrown away (stale or timed out) in step k
  wire_bytes: float      # bytes one device sends per step (clock exchange + gradient sum)
  params: Any            # the final parameters

  def loss_at(self, t: float) -> float:
    """Loss of the last iterate that exists at simulated time `t`."""
    return float(self.loss[np.searchsorted(self.time, t, side="right") - 1])

  def time_to(self, target: float) -> float:
    """First simulated time the loss is <= `target` (inf if never)."""
    hit = np.nonzero(self.loss <= target)[0]
    return float(self.time[hit[0]]) if hit.size else float("inf")


def _masked_grad_sum(grad_fn, params, key, worker, jobs, mask):
  """sum_j mask_j * grad_fn(params, key(worker, job_j)): one worker's share of a step."""
  keys = jax.vmap(lambda j: jax.random.fold_in(jax.random.fold_in(key, worker), j))(jobs)
  grads = jax.vmap(grad_fn, in_axes=(None, 0))(params, keys)
  return jax.tree.map(lambda g: jnp.tensordot(mask.astype(g.dtype), g, axes=1), grads)


def _step_sgd(params, grad_sum, scale):
  return jax.tree.map(lambda p, g: p - (scale * g).astype(p.dtype), params, grad_sum)


class _Ctx(NamedTuple):
  axes: tuple
  num_workers: int
  worker: jax.Array
  time_key: jax.Array
  grad_key: jax.Array
  compute: ComputeModel
  grad_fn: Callable
  lr: float


def _synchronous(ctx: _Ctx, method: Method, params):
  del method

  def init(x):
    return {"x": x, "t": jnp.zeros((), jnp.float32), "job": comm.varying(jnp.zeros((), jnp.int32),
                                                                          ctx.axes)}

  def step(c, k):
    del k
    tau = ctx.compute.times(ctx.time_key, ctx.worker, c["job"][None])[0]
    taus, b1 = comm.all_gather(tau, ctx.axes)
    grads = _masked_grad_sum(ctx.grad_fn, c["x"], ctx.grad_key, ctx.worker, c["job"][None],
                             jnp.ones((1,)))
    total, b2 = comm.sum(grads, ctx.axes)
    x = _step_sgd(c["x"], total, ctx.lr / ctx.num_workers)
    record = (jnp.ones((ctx.num_workers,), jnp.int32), jnp.zeros((), jnp.int32),
              jnp.zeros((), jnp.int32))
    return {"x": x, "t": c["t"] + jnp.max(taus), "job": c["job"] + 1}, record, b1 + b2

  return init(params), step


def _asynchronous(ctx: _Ctx, method: Method, params):
  del method

  def init(x):
    first = ctx.compute.times(ctx.time_key, ctx.worker, jnp.zeros((1,), jnp.int32))[0]
    return {"x": x, "t": jnp.zeros((), jnp.float32),
            "snapshot": comm.varying(x, ctx.axes),            # the iterate it computes at
            "start": comm.varying(jnp.zeros((), jnp.int32), ctx.axes),  # its step number
            "busy": first,                                     # when its gradient arrives
            "job": comm.varying(jnp.zeros((), jnp.int32), ctx.axes)}

  def step(c, k):
    clocks, b1 = comm.all_gather((c["busy"], c["start"]), ctx.axes)
    arrival = jnp.argmin(clocks[0])  # first arrival; ties go to the lower worker index
    mine = ctx.worker == arrival
    grads = _masked_grad_sum(ctx.grad_fn, c["snapshot"], ctx.grad_key, ctx.worker,
                             c["job"][None], mine[None])
    total, b2 = comm.sum(grads, ctx.axes)
    t = clocks[0][arrival]
    x = _step_sgd(c["x"], total, ctx.lr)
    nxt = ctx.compute.times(ctx.time_key, ctx.worker, (c["job"] + 1)[None])[0]
    new = {"x": x, "t": t,
           "snapshot": jax.tree.map(lambda s, n: jnp.where(mine, comm.varying(n, ctx.axes), s),
                                    c["snapshot"], x),
           "start": jnp.where(mine, k + 1, c["start"]),
           "busy": jnp.where(mine, t + nxt, c["busy"]),
           "job": c["job"] + mine.astype(jnp.int32)}
    record = (jax.nn.one_hot(arrival, ctx.num_workers, dtype=jnp.int32),
              k - clocks[1][arrival], jnp.zeros((), jnp.int32))
    return new, record, b1 + b2

  return init(params), step


def _rennala(ctx: _Ctx, method: Method, params):
  batch = method.batch
  w_all = jnp.arange(ctx.num_workers)

  def init(x):
    zero = lambda dt: comm.varying(jnp.zeros((), dt), ctx.axes)
    return {"x": x, "t": jnp.zeros((), jnp.float32),
            "ready": zero(jnp.float32),  # when the worker is free to start on the iterate
            "job": zero(jnp.int32)}      # computations it has started so far

  def step(c, k):
    del k
    # A worker may deliver at most `batch` fresh gradients before the server steps.
    jobs = c["job"] + jnp.arange(batch)
    taus = ctx.compute.times(ctx.time_key, ctx.worker, jobs)
    starts = c["ready"] + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(taus)])  # [B + 1]
    starts_all, b1 = comm.all_gather(starts, ctx.axes)                          # [W, B + 1]
    done = starts_all[:, 1:].reshape(-1)
    order = jnp.argsort(done, stable=True)  # ties: lower worker, then earlier job
    t = done[order[batch - 1]]              # the batch-th fresh gradient triggers the step
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    counted = (rank < batch).reshape(ctx.num_workers, batch).sum(1)  # [W], a prefix each
    # The computation after the counted ones started on this iterate before the step: it
    # is stale and will be discarded when it finishes; the worker is busy until then.
    next_start = starts_all[w_all, counted]
    in_flight = next_start < t
    next_done = starts_all[w_all, jnp.minimum(counted + 1, batch)]
    ready_all = jnp.where(in_flight, next_done, next_start)
    mine = counted[ctx.worker]
    grads = _masked_grad_sum(ctx.grad_fn, c["x"], ctx.grad_key, ctx.worker, jobs,
                             jnp.arange(batch) < mine)
    total, b2 = comm.sum(grads, ctx.axes)
    x = _step_sgd(c["x"], total, ctx.lr / batch)
    new = {"x": x, "t": t, "ready": ready_all[ctx.worker],
           "job": c["job"] + mine + in_flight[ctx.worker].astype(jnp.int32)}
    record = (counted.astype(jnp.int32), jnp.zeros((), jnp.int32),
              in_flight.sum().astype(jnp.int32))
    return new, record, b1 + b2

  return init(params), step


def _mindflayer(ctx: _Ctx, method: Method, params):
  trials_table, allot_table = method.trials, method.allotted
  max_trials = int(trials_table.max())
  pick = lambda table: jnp.asarray(table)[ctx.worker] if table.shape[0] > 1 else \
      jnp.asarray(table[0])

  def init(x):
    return {"x": x, "t": jnp.zeros((), jnp.float32),
            "job": comm.varying(jnp.zeros((), jnp.int32), ctx.axes)}

  def step(c, k):
    del k
    trials, allotted = pick(trials_table), pick(allot_table)
    jobs = c["job"] + jnp.arange(max_trials)
    taus = ctx.compute.times(ctx.time_key, ctx.worker, jobs)
    active = jnp.arange(max_trials) < trials
    finished = active & (taus <= allotted)
    elapsed = jnp.sum(jnp.where(active, jnp.minimum(taus, allotted), 0.0))
    stats = jnp.stack([elapsed, finished.sum(), (active & ~finished).sum()]).astype(jnp.float32)
    stats_all, b1 = comm.all_gather(stats, ctx.axes)  # [W, 3]
    grads = _masked_grad_sum(ctx.grad_fn, c["x"], ctx.grad_key, ctx.worker, jobs, finished)
    total, b2 = comm.sum(grads, ctx.axes)
    count = stats_all[:, 1].sum()
    x = jax.tree.map(lambda new, old: jnp.where(count > 0, new, old),
                     _step_sgd(c["x"], total, ctx.lr / jnp.maximum(count, 1.0)), c["x"])
    new = {"x": x, "t": c["t"] + stats_all[:, 0].max(), "job": c["job"] + trials}
    record = (stats_all[:, 1].astype(jnp.int32), jnp.zeros((), jnp.int32),
              stats_all[:, 2].sum().astype(jnp.int32))
    return new, record, b1 + b2

  return init(params), step


_BUILDERS = {"synchronous": _synchronous, "asynchronous": _asynchronous,
             "rennala": _rennala, "mindflayer": _mindflayer}


def simulate_workers(method: Method, grad_fn: Callable, loss_fn: Callable, params: Any,
             compute: ComputeModel, *, mesh: jax.sharding.Mesh, steps: int, lr: float,
             axis_name: str = "data", key: jax.Array | None = None) -> SimResult:
  """Runs `steps` server steps of `method` on the workers of `axis_name`.

  Args:
    method: `synchronous_sgd()`, `asynchronous_sgd()`, `rennala_sgd(B)` or
      `mindflayer_sgd(t, trials)`.
    grad_fn: `(params, key) -> grads`, one stochastic gradient (the key draws its sample).
    loss_fn: `params -> scalar`, the objective recorded at every iterate.
    params: initial parameters (replicated).
    compute: the workers' `ComputeModel`.
    mesh: the device mesh; each device of `axis_name` is one worker.
    steps: number of server steps (each is one parameter update).
    lr: step size; the step is -lr times the mean of the gradients used.
    axis_name: the mesh axis of the workers.
    key: PRNG key of compute times and gradient noise; None is the fixed default
      `jax.random.key(0)`.

  Returns:
    A `SimResult` (numpy arrays on the host).

  Raises:
    ValueError: bad steps, lr, axis, or a compute model / method sized for other workers.

  >>> from jaxcomm import sim, train
  >>> mesh = train.make_mesh({"data": 8})
  >>> r = simulate_workers(rennala_sgd(8), lambda p, key: p, lambda p: jnp.sum(p ** 2),
  ...              jnp.ones(2), sim.fixed([1.0] * 7 + [10.0]), mesh=mesh, steps=3, lr=0.5)
  >>> r.time.tolist(), r.used[0].tolist()
  ([0.0, 2.0, 4.0, 6.0], [2, 1, 1, 1, 1, 1, 1, 0])
  """
  v.one_of("method.kind", method.kind, METHODS)
  steps = v.integer("steps", steps, low=1)
  lr = v.number("lr", lr, low=0.0, low_open=True)
  axis_name = v.one_of("axis_name", axis_name, mesh.axis_names)
  num_workers = mesh.shape[axis_name]
  compute.check(num_workers)
  if method.kind == "mindflayer":
    for name, table in (("allotted", method.allotted), ("trials", method.trials)):
      if table.shape[0] not in (1, num_workers):
        raise ValueError(f"mindflayer {name} has {table.shape[0]} values for "
                         f"{num_workers} workers.")
  time_key, grad_key = jax.random.split(v.key("key", key))
  axes = (axis_name,)
  nbytes = {}

  def run(x0):
    ctx = _Ctx(axes, num_workers, lax.axis_index(axis_name), time_key, grad_key, compute,
               grad_fn, lr)
    carry, step = _BUILDERS[method.kind](ctx, method, x0)

    def body(c, k):
      c, (used, stale, dropped), sent = step(c, k)
      nbytes["step"] = sent
      return c, (c["t"], loss_fn(c["x"]), used, stale, dropped)

    carry, records = lax.scan(body, carry, jnp.arange(steps, dtype=jnp.int32))
    return carry["x"], loss_fn(x0), records

  specs = jax.tree.map(lambda _: P(), params)
  out = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(specs,),
                              out_specs=(specs, P(), P())))(params)
  x, loss0, (t, loss, used, stale, dropped) = jax.device_get(out)
  return SimResult(method=method.name,
                   time=np.concatenate([[0.0], np.asarray(t, np.float64)]),
                   loss=np.concatenate([[float(loss0)], np.asarray(loss, np.float64)]),
                   used=np.asarray(used), staleness=np.asarray(stale),
                   discarded=np.asarray(dropped), wire_bytes=float(nbytes["step"]), params=x)
