"""Pier: DiLoCo whose outer momentum follows a schedule (warm-up, then decay)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.local import _diloco


def pier_momentum(peak: float = 0.9, warmup: int = 10, *, initial: float = 0.0,
                  decay_from: int | None = None, total: int | None = None,
                  final: float = 0.0) -> optax.Schedule:
  """An outer-momentum schedule of the outer step count: linear warm-up from `initial` to
  `peak` over the first `warmup` outer steps, then `peak`, then (with `decay_from` and
  `total`) linear decay to `final` from outer step `decay_from` to `total`.

  Pier warms the outer momentum up and decays it late in training; the linear shape and these
  defaults are our choices, not the paper's settings (its text was not at hand).

  Args:
    peak: the momentum after the warm-up, in [0, 1).
    warmup: outer steps of the warm-up (0: none).
    initial: the momentum at outer step 0.
    decay_from: the outer step where the decay starts (None: no decay).
    total: the outer step where the decay ends (needed with `decay_from`).
    final: the momentum at `total` and after.

  Returns:
    An optax schedule (outer step -> momentum) for `pier(momentum=...)`.

  >>> f = pier_momentum(0.9, 3, decay_from=6, total=8)
  >>> [round(float(f(k)), 2) for k in range(10)]
  [0.0, 0.3, 0.6, 0.9, 0.9, 0.9, 0.9, 0.45, 0.0, 0.0]
  """
  unit = lambda name, x: v.number(name, x, low=0.0, high=1.0, high_open=True)
  peak, initial, final = unit("peak", peak), unit("initial", initial), unit("final", final)
  warmup = v.integer("warmup", warmup, low=0)
  if (decay_from is None) != (total is None):
    raise ValueError(f"decay_from and total go together; got decay_from={decay_from!r}, "
                     f"total={total!r}.")
  parts = [optax.linear_schedule(initial, peak, max(warmup, 1))] if warmup else []
  bounds = [warmup] if warmup else []
  parts.append(optax.constant_schedule(peak))
  if decay_from is not None:
    decay_from = v.integer("decay_from", decay_from, low=warmup)
    total = v.integer("total", total, low=decay_from + 1)
    parts.append(optax.linear_schedule(peak, final, total - decay_from))
    bounds.append(decay_from)
  return optax.join_schedules(parts, bounds) if bounds else parts[0]


class ScheduledTraceState(NamedTuple):
  """State of Pier's outer momentum."""
  count: jax.Array  # i32[]: outer steps taken (the schedule's argument)
  trace: Any        # like params: the momentum buffer


def _scheduled_trace(momentum, nesterov: bool) -> optax.GradientTransformation:
  """optax.trace whose decay is `momentum(count)`, cast to each leaf's dtype."""
  decay = momentum if callable(momentum) else (lambda count: momentum)

  def init_fn(params):
    return ScheduledTraceState(jnp.zeros((), jnp.int32), optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    del params
    mu = jnp.asarray(decay(state.count))
    trace = jax.tree.map(lambda g, t: g + mu.astype(g.dtype) * t, updates, state.trace)
    if nesterov:
      updates = jax.tree.map(lambda g, t: g + mu.astype(g.dtype) * t, updates, trace)
    else:
      updates = trace
    return updates, ScheduledTraceState(optax.safe_increment(state.count), trace)

  return optax.GradientTransformation(init_fn, update_fn)


def pier(inner: optax.GradientTransformation, sync_every: int,
         axis_name: comm.AxisName = "data", *, outer_lr: optax.ScalarOrSchedule = 0.7,
         momentum: optax.ScalarOrSchedule = 0.9, nesterov: bool = True,
         **diloco_kwargs) -> optax.GradientTransformationExtraArgs:
  """Pier: DiLoCo (`local.diloco`) whose outer Nesterov momentum is a schedule of the outer
  step count (`pier_momentum`: warm-up, then decay).

  The outer optimiser is `optax.sgd`'s momentum (`optax.trace`) with its decay `momentum`
  evaluated at the number of outer steps so far (its own counter, checkpointed with it), and
  the learning rate `outer_lr`. A constant `momentum` is DiLoCo with
  `optax.sgd(outer_lr, momentum, nesterov)`. Bytes are DiLoCo's.

  Args:
    inner: the optimiser each worker runs.
    sync_every: H >= 1, inner steps between outer steps.
    axis_name: the workers' axis (or tuple); None: one worker.
    outer_lr: the outer learning rate (a number or schedule of the outer step).
    momentum: the outer momentum, a number in [0, 1) or a schedule (`pier_momentum`).
    nesterov: Nesterov momentum, as DiLoCo's outer step.
    **diloco_kwargs: `local.diloco`'s other arguments (codec, participation, eager, ...).

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Fan, Zhang, Pier: Efficient Large Language Model pretraining with Relaxed Global
    Communication, arXiv 2511.17849.

  >>> import jax.numpy as jnp, optax
  >>> tx = pier(optax.sgd(0.1), 1, None, momentum=pier_momentum(0.9, 2))
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> state.outer_params["w"]  # outer step 0: momentum 0, x - 0.7 * 0.1
  Array([0.93, 0.93], dtype=float32)
  """
  if not callable(outer_lr):
    v.number("outer_lr", outer_lr, low=0.0, low_open=True)
  if not callable(momentum):
    v.number("momentum", momentum, low=0.0, high=1.0, high_open=True)
  if "outer" in diloco_kwargs:
    raise ValueError("pier builds the outer optimiser from outer_lr, momentum and nesterov; "
                     "do not pass outer.")
  outer = optax.chain(_scheduled_trace(momentum, v.flag("nesterov", nesterov)),
                      optax.scale_by_learning_rate(outer_lr))
  return _diloco.diloco(inner, outer, sync_every, axis_name, **diloco_kwargs)
