"""ACCO: accumulate while communicating, with a ZeRO-1-sharded optimiser."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import codecs
from jaxcomm import comm


class AccoState(NamedTuple):
  """State of `acco`. S: parameters flattened and zero-padded to a multiple of W."""
  count: jax.Array             # i32[]: rounds taken; odd rounds estimate, even rounds real
  grad_buffer: jax.Array       # f32[S], per worker: sum of this worker's micro-batch
                               # gradients since the last real round (not yet reduced)
  micro_count: jax.Array       # i32[], per worker: micro-batches in grad_buffer
  param_shard: jax.Array       # f32[S/W], per worker: this worker's shard of theta_t
  inner_state: optax.OptState  # inner optimiser state of the shard, per worker (1/W of DP's)
  wire_bytes: jax.Array        # u32[]: cumulative bytes sent (mod 2**32)


def _check_micro_batches(micro_batches) -> tuple[int, ...] | int:
  """An int (every worker the same) or one positive int per worker."""
  what = "micro_batches (one int, or one per worker)"
  if isinstance(micro_batches, (tuple, list, np.ndarray)):
    if len(micro_batches) == 0:
      raise ValueError(f"{what} must not be empty, got {micro_batches!r}.")
    return tuple(v.integer(what, n, low=1, high=2**31 - 1) for n in micro_batches)
  return v.integer(what, micro_batches, low=1, high=2**31 - 1)


def _worker_count(counts, axis_name: comm.AxisName) -> jax.Array:
  """This worker's micro-batches per round: i32[] (varying when counts differ)."""
  if isinstance(counts, int):
    return jnp.asarray(counts, jnp.int32)
  w = comm.axis_size(axis_name)
  if len(counts) != w:
    raise ValueError(f"micro_batches has {len(counts)} entries but axis_name={axis_name!r} "
                     f"has {w} workers; give one count per worker.")
  if axis_name is None:
    return jnp.asarray(counts[0], jnp.int32)
  return jnp.asarray(counts, jnp.int32)[lax.axis_index(axis_name)]


def _padded(n: int, w: int) -> int:
  return n + (-n) % w


def micro_batch_loss(loss_fn: Callable, micro_batches: int | Sequence[int],
                     axis_name: comm.AxisName = "data") -> Callable:
  """A worker's mean loss over the micro-batches it reaches in one round.

  Worker w splits its share of the batch into M = max(micro_batches) micro-batches and
  accumulates the first n_w of them (`lax.scan`, one micro-batch at a time, as a slow worker
  would); the rest stand for the ones it does not reach before the round's communication
  ends. The result is the mean over those n_w micro-batch losses (an `(loss, aux)` pair is
  averaged leaf by leaf), so the Trainer's gradient
  is the accumulated gradient divided by n_w: `acco` with the same `micro_batches` weights it
  back by n_w. Every leaf of the worker's batch must have a leading size divisible by M.

  Args:
    loss_fn: `loss_fn(params, micro_batch) -> loss` (or `-> (loss, aux)`).
    micro_batches: micro-batches per worker and round: an int or one int per worker.
    axis_name: the data axis the workers are on (the worker index picks its count).

  Returns:
    `loss(params, batch)` for `jaxcomm.train.Trainer`.

  >>> import jax.numpy as jnp
  >>> loss = micro_batch_loss(lambda p, b: jnp.mean(b["x"]) * p, 2, axis_name=None)
  >>> float(loss(1.0, {"x": jnp.arange(4.0)}))
  1.5
  """
  counts = _check_micro_batches(micro_batches)
  loss_fn = v.callable_("loss_fn", loss_fn)
  axis_name = v.axis_name("axis_name", axis_name)
  m = counts if isinstance(counts, int) else max(counts)

  def loss(params, batch):
    n_w = _worker_count(counts, axis_name)

    def split(x):
      if x.shape[0] % m:
        raise ValueError(f"each worker's batch ({x.shape[0]}) must be divisible by the number "
                         f"of micro-batches ({m}).")
      return x.reshape(m, x.shape[0] // m, *x.shape[1:])

    micro = jax.tree.map(split, batch)
    out_abs = jax.eval_shape(loss_fn, params, jax.tree.map(lambda x: x[0], micro))
    # The carry must vary over the axes the body's sum does (shard_map's scan rule): the
    # worker axes (n_w picks per worker) and whatever the loss varies over, such as the
    # fsdp or tensor axes that split the batch or the parameters inside a replica.
    zero = jax.tree.map(lambda a: comm.varying(
        jnp.zeros(a.shape, a.dtype),
        tuple(comm.axis_names(axis_name)) + tuple(sorted(comm.varying_axes(a)))), out_abs)

    def body(total, xs):
      i, mb = xs
      out = loss_fn(params, mb)
      keep = i < n_w
      return jax.tree.map(lambda t, o: t + jnp.where(keep, o, jnp.zeros_like(o)), total,
                          out), None

    total, _ = lax.scan(body, zero, (jnp.arange(m), micro))
    return jax.tree.map(lambda t: t / n_w.astype(t.dtype), total)

  return loss


def acco(inner: optax.GradientTransformation, axis_name: comm.AxisName = "data",
         micro_batches: int | Sequence[int] = 1) -> optax.GradientTransformationExtraArgs:
  """ACCO's estimate and real rounds over a ZeRO-1-sharded inner optimiser.

  Each call is one round. The gradients a worker accumulated in earlier rounds travel while
  this round's micro-batches are computed (no data dependence between them): the round
  psums the micro-batch counts, reduce-scatters the flattened gradient sum (padded to a
  multiple of W), divides its 1/W shard by the global count, steps the inner optimiser on
  that shard of the parameters and all-gathers the new parameters. Rounds alternate:

  * estimate (odd rounds): the step from theta_t with the gradients of the previous round
    gives theta~_{t+1}, the parameters the next micro-batches are computed at; the
    parameter shard and inner state are then restored to theta_t's and the gradient buffer
    is kept, so this round's gradients (computed at theta_t) are added to it;
  * real (even rounds): theta_{t+1} steps from theta_t with the gradients of both rounds
    (half at theta~_t's estimate, half at theta_t): a full batch per real update, without
    the one-step delay bias of `delayed`. The buffer then restarts with this round's
    gradients (computed at theta~_{t+1}).

  Round 0 has nothing to send (a zero buffer, count 0) and leaves everything unchanged; real
  update t happens at round 2t + 2. The Trainer's gradient on worker w must be the mean over
  the n_w micro-batches it accumulated (see `micro_batch_loss`); the buffer keeps n_w times
  it, so the reduced gradient is the mean over every micro-batch of every worker. Wire bytes
  per round: 2(W-1)/W * 4 (counts) + (W-1)/W * 4S (reduce-scatter) + (W-1) * 4S/W
  (all-gather).

  The inner optimiser runs on a flat f32 shard of the parameters, so it must be elementwise
  (sgd, momentum, adam, adamw, lion...; not global-norm clipping or per-layer trust ratios).
  Its state, the parameter shard and the inner state are per worker and 1/W of exact data
  parallelism's; the gradient buffer is one flat f32 copy of the parameters per worker. The
  alternation and the restore follow our reading of the paper (docs/algorithms.md); the
  paper's two CUDA streams are one SPMD program here (the overlap is the absence of a data
  dependence, which the compiled HLO shows).

  Args:
    inner: an elementwise optimiser stepped on the parameter shard.
    axis_name: the data axis (or tuple of axes); None for one device.
    micro_batches: micro-batches each worker accumulates per round: an int (all equal) or a
      sequence of positive ints, one per worker (heterogeneous hardware).

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params`.

  References:
    Nabli et al., ACCO: Accumulate While You Communicate, arXiv 2406.02613; Rajbhandari et
    al., ZeRO, arXiv 1910.02054.

  >>> import jax.numpy as jnp, optax
  >>> tx = acco(optax.sgd(1.0), axis_name=None)
  >>> p = {"w": jnp.zeros(2)}
  >>> state = tx.init(p)
  >>> u0, state = tx.update({"w": jnp.ones(2)}, state, p)  # round 0: nothing to send yet
  >>> u1, state = tx.update({"w": 3 * jnp.ones(2)}, state, p)  # estimate from round 0's
  >>> p1 = {"w": p["w"] + u1["w"]}
  >>> u2, state = tx.update({"w": jnp.ones(2)}, state, p1)  # real: mean of rounds 0 and 1
  >>> u0["w"].tolist(), u1["w"].tolist(), (p1["w"] + u2["w"]).tolist()
  ([0.0, 0.0], [-1.0, -1.0], [-2.0, -2.0])
  """
  counts = _check_micro_batches(micro_batches)
  inner = optax.with_extra_args_support(v.transform("inner", inner))
  axis_name = v.axis_name("axis_name", axis_name)

  def shard_of(flat):
    w = comm.axis_size(axis_name)
    s = flat.shape[0] // w
    r = 0 if axis_name is None else lax.axis_index(axis_name)
    return lax.dynamic_slice_in_dim(flat, r * s, s)

  def init_fn(params):
    flat, _ = codecs.flatten(params)
    w = comm.axis_size(axis_name)
    _worker_count(counts, axis_name)  # Validates the number of counts against W.
    flat = jnp.pad(flat, (0, _padded(flat.shape[0], w) - flat.shape[0]))
    shard = shard_of(flat)
    return AccoState(count=jnp.zeros((), jnp.int32), grad_buffer=jnp.zeros_like(flat),
                     micro_count=jnp.zeros((), jnp.int32), param_shard=shard,
                     inner_state=inner.init(shard), wire_bytes=comm.zero_bytes())

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axis_name, "local.acco")
    if params is None:
      raise ValueError("acco needs params: call update(grads, state, params).")
    # What travels this round is state (earlier rounds' gradients), not `updates`.
    total, nb_count = comm.sum(state.micro_count, axis_name)
    shard_sum, nb_rs = comm.reduce_scatter(state.grad_buffer, axis_name)
    grad_shard = shard_sum / jnp.maximum(total, 1).astype(shard_sum.dtype)
    steps, stepped_inner = inner.update(grad_shard, state.inner_state, state.param_shard,
                                        **extra_args)
    stepped = optax.apply_updates(state.param_shard, steps)
    ready = total > 0  # Round 0: nothing accumulated yet.
    stepped = jnp.where(ready, stepped, state.param_shard)
    stepped_inner = jax.tree.map(lambda a, b: jnp.where(ready, a, b), stepped_inner,
                                 state.inner_state)
    gathered, nb_ag = comm.all_gather(stepped, axis_name, tiled=True)
    # The Trainer's parameters become theta~ (estimate) or theta_{t+1} (real).
    flat_params, unflatten = codecs.flatten(params)
    new_params = unflatten(gathered[:flat_params.shape[0]])
    moves = jax.tree.map(lambda a, b: (a - b).astype(b.dtype), new_params, params)
    # Real rounds commit; estimate rounds restore theta_t's shard and inner state.
    real = state.count % 2 == 0
    shard = jnp.where(real, stepped, state.param_shard)
    inner_state = jax.tree.map(lambda a, b: jnp.where(real, a, b), stepped_inner,
                               state.inner_state)
    # Buffer this round's gradient sum (n_w micro-batches): restart after a real round.
    n_w = _worker_count(counts, axis_name)
    local, _ = codecs.flatten(updates)
    local = jnp.pad(local, (0, state.grad_buffer.shape[0] - local.shape[0]))
    local = local * n_w.astype(local.dtype)
    buffer = jnp.where(real, local, state.grad_buffer + local)
    micro_count = jnp.where(real, n_w, state.micro_count + n_w)
    wire = comm.add_bytes(state.wire_bytes, nb_count + nb_rs + nb_ag)
    return moves, AccoState(count=state.count + 1, grad_buffer=buffer, micro_count=micro_count,
                            param_shard=shard, inner_state=inner_state, wire_bytes=wire)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
