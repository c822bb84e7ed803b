"""PipeMare: an asynchronous pipeline's stale weights, simulated on a staged model.

In an asynchronous (flush-free) pipeline of S stages, stage i runs its forward pass on
weights tau_fwd[i] optimiser steps old and its backward pass on fresher ones (tau_bwd[i]
steps old), because updates land while a micro-batch is in flight. This module simulates that
on one device for any model written as a list of stages `stage(params_i, x) -> x`: it keeps a
ring buffer of each stage's recent weights, runs every stage's forward on its stale weights
and its backward (weight and input gradients, from the stashed input activation) on its
backward weights. With all delays 0 it is plain synchronous SGD, the reference schedule.

PipeMare's two techniques (Yang et al., arXiv 1910.05124):
* learning-rate rescheduling: stage i steps with lr * tau_i^-p, p = 1 - min(t / warmup, 1),
  i.e. lr / tau_i at the start, annealed to lr by the end of the warm-up;
* discrepancy correction: the backward pass uses w - (tau_fwd - tau_bwd) * v, with v an
  exponential moving average of the weight velocity w_{t+1} - w_t, an estimate of the stale
  forward weights.
Real stages on a `pipeline` mesh axis run the flushed schedules `jaxcomm.parallel.schedule_gpipe`
and `schedule_1f1b`, which wait for every micro-batch and so have no stale weights; this module
simulates the flush-free pipeline those schedules avoid, to measure what its staleness costs.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import _validate as v


def pipeline_delays(num_stages: int, num_microbatches: int = 1) -> tuple[int, ...]:
  """Forward weight delays of an asynchronous pipeline: ceil((2 (S - i) - 1) / N), i = 0..S-1.

  A micro-batch's forward pass at stage i and its backward pass there are 2 (S - i) - 1
  micro-batch slots apart, and N micro-batches make one optimiser step, so that many updates
  land in between (PipeMare, Section 3; the last stage is one step stale).

  >>> pipeline_delays(4)
  (7, 5, 3, 1)
  """
  num_stages = v.integer("num_stages", num_stages, low=1)
  num_microbatches = v.integer("num_microbatches", num_microbatches, low=1)
  return tuple(math.ceil((2 * (num_stages - i) - 1) / num_microbatches)
               for i in range(num_stages))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stage(fn, w_fwd, w_bwd, x):
  """fn(w_fwd, x) forward; the backward pass differentiates fn at (w_bwd, x)."""
  del w_bwd
  return fn(w_fwd, x)


def _stage_fwd(fn, w_fwd, w_bwd, x):
  return fn(w_fwd, x), (w_bwd, x)  # the input activation is stashed, not the weights


def _stage_bwd(fn, residuals, dy):
  w_bwd, x = residuals
  _, vjp = jax.vjp(fn, w_bwd, x)
  dw, dx = vjp(dy)
  # The weight gradient is credited to the forward weights: it is this stage's update.
  return dw, jax.tree.map(jnp.zeros_like, w_bwd), dx


_stage.defvjp(_stage_fwd, _stage_bwd)


class PipeMareState(NamedTuple):
  """State of the simulated asynchronous pipeline."""
  step: jax.Array     # i32[]: optimiser steps taken
  params: tuple       # per stage: current weights w_t
  history: tuple      # per stage: [H, ...] ring buffer, slot s mod H holds w_s (w_0 before)
  velocity: tuple     # per stage: EMA of w_{t+1} - w_t


class PipeMareResult(NamedTuple):
  losses: np.ndarray  # f32[K]: training loss of every step (as the pipeline computed it)
  params: tuple       # final per-stage weights


def _delays(name, value, num_stages) -> np.ndarray:
  arr = np.broadcast_to(np.asarray(value), (num_stages,)) if np.ndim(value) == 0 else \
      np.asarray(value)
  if arr.shape != (num_stages,) or not np.issubdtype(arr.dtype, np.integer) or np.any(arr < 0):
    raise ValueError(f"{name} must be one int >= 0 per stage ({num_stages}), got {value!r}.")
  return arr.astype(np.int64)


def pipemare_sgd(stages: Sequence[Callable], loss_fn: Callable, params: Sequence[Any],
                 batches: Any, *, lr: float, forward_delays: Sequence[int] | None = None,
                 backward_delays: Sequence[int] | int = 0, lr_rescheduling: bool = False,
                 warmup_steps: int = 0, discrepancy_correction: bool = False,
                 velocity_decay: float = 0.9) -> PipeMareResult:
  """Trains a staged model with SGD under per-stage weight staleness, optionally PipeMare's.

  Args:
    stages: S functions `stage(params_i, x) -> x`, applied in order.
    loss_fn: `(output of the last stage, batch) -> scalar`; the first stage gets
      `batch["x"]`.
    params: S parameter pytrees.
    batches: a pytree whose leaves have a leading axis of K steps (one batch per step).
    lr: the base step size.
    forward_delays: tau_fwd per stage (default `pipeline_delays(S)`); all zeros is the
      synchronous schedule.
    backward_delays: tau_bwd per stage (<= tau_fwd), default 0 (the latest weights).
    lr_rescheduling: PipeMare T1 (needs `warmup_steps` > 0).
    warmup_steps: steps over which the rescheduled rate anneals to `lr`.
    discrepancy_correction: PipeMare T2.
    velocity_decay: the EMA decay of the weight velocity (T2).

  Returns:
    `PipeMareResult(losses per step, final params)`.

  References:
    Yang, Zhang, Li, Rao, De Sa, PipeMare: asynchronous pipeline parallel DNN training,
    arXiv 1910.05124.

  >>> stage = lambda w, x: jnp.tanh(x * w)
  >>> out = pipemare_sgd([stage, stage], lambda y, b: jnp.mean((y - b["y"]) ** 2),
  ...                    [jnp.ones(()), jnp.ones(())],
  ...                    {"x": jnp.ones((3, 4)), "y": jnp.zeros((3, 4))}, lr=0.1)
  >>> out.losses.shape
  (3,)
  """
  num_stages = len(stages)
  if num_stages < 1 or len(params) != num_stages:
    raise ValueError(f"need one params pytree per stage: {num_stages} stages, "
                     f"{len(params)} params.")
  fwd = _delays("forward_delays", pipeline_delays(num_stages) if forward_delays is None
                else forward_delays, num_stages)
  bwd = _delays("backward_delays", backward_delays, num_stages)
  if np.any(bwd > fwd):
    raise ValueError(f"backward_delays {bwd.tolist()} must not exceed forward_delays "
                     f"{fwd.tolist()} (the backward pass runs after the forward).")
  lr = v.number("lr", lr, low=0.0, low_open=True)
  if lr_rescheduling and warmup_steps < 1:
    raise ValueError("lr_rescheduling needs warmup_steps >= 1.")
  velocity_decay = v.number("velocity_decay", velocity_decay, low=0.0, high=1.0,
                            high_open=True)
  depth = int(fwd.max()) + 1  # ring buffer length: enough for the oldest weights needed
  taus = np.maximum(fwd, 1).astype(np.float32)

  def weights_at(history, t, delay):
    return jax.tree.map(lambda h: h[jnp.mod(t - delay, depth)], history)

  def loss_of(fwd_weights, bwd_weights, batch):
    x = batch["x"]
    for fn, wf, wb in zip(stages, fwd_weights, bwd_weights):
      x = _stage(fn, wf, wb, x)
    return loss_fn(x, batch)

  def step(state: PipeMareState, batch):
    t = state.step
    w_fwd = tuple(weights_at(h, t, int(d)) for h, d in zip(state.history, fwd))
    if discrepancy_correction:
      w_bwd = tuple(jax.tree.map(lambda w, u, gap=float(f - b): w - gap * u, p, vel)
                    for p, vel, f, b in zip(state.params, state.velocity, fwd, bwd))
    else:
      w_bwd = tuple(weights_at(h, t, int(d)) for h, d in zip(state.history, bwd))
    loss, grads = jax.value_and_grad(loss_of)(w_fwd, w_bwd, batch)
    if lr_rescheduling:
      power = 1.0 - jnp.minimum(t / warmup_steps, 1.0)
      rates = [lr * tau ** -power for tau in taus]
    else:
      rates = [lr] * num_stages
    new_params = tuple(jax.tree.map(lambda w, g, r=r: w - r * g, p, g)
                       for p, g, r in zip(state.params, grads, rates))
    velocity = tuple(jax.tree.map(lambda u, n, o: velocity_decay * u + (1 - velocity_decay)
                                  * (n - o), vel, new, old)
                     for vel, new, old in zip(state.velocity, new_params, state.params))
    slot = jnp.mod(t + 1, depth)
    history = tuple(jax.tree.map(lambda h, w: h.at[slot].set(w), hist, p)
                    for hist, p in zip(state.history, new_params))
    return PipeMareState(t + 1, new_params, history, velocity), loss

  params = tuple(jax.tree.map(jnp.asarray, p) for p in params)
  state = PipeMareState(
      step=jnp.zeros((), jnp.int32), params=params,
      history=tuple(jax.tree.map(lambda w: jnp.broadcast_to(w, (depth, *w.shape)), p)
                    for p in params),
      velocity=tuple(jax.tree.map(jnp.zeros_like, p) for p in params))
  final, losses = jax.jit(lambda s, b: lax.scan(step, s, b))(state, batches)
  return PipeMareResult(losses=np.asarray(losses), params=final.params)
