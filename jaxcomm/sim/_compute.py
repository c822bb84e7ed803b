"""Compute time per step: measured on this machine, or FLOPs over a stated peak."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np

from jaxcomm import _validate as v


def measure_seconds(fn: Callable, *args: Any, repeats: int = 5, warmup: int = 1,
                    statistic: str = "median") -> float:
  """Wall-clock seconds of `fn(*args)` on this machine, after compiling and warming up.

  Use it on one worker's step without communication (the transform built with
  `axis_name=None`, on that worker's share of the batch): the simulation adds the network.

  Args:
    fn: a function of arrays (jitted here if it is not already).
    *args: its arguments.
    repeats: timed calls.
    warmup: untimed calls first (the first one compiles).
    statistic: "median" of the timed calls, or "min": the least disturbed by other
      programs on a shared machine.

  >>> import jax.numpy as jnp
  >>> measure_seconds(lambda x: x @ x, jnp.ones((8, 8)), repeats=2) > 0
  True
  """
  repeats = v.integer("repeats", repeats, low=1)
  warmup = v.integer("warmup", warmup, low=0)
  statistic = v.one_of("statistic", statistic, ("median", "min"))
  # A jitted function, or a program compiled already (`jax.jit(f).lower(...).compile()`).
  jitted = fn if hasattr(fn, "lower") or hasattr(fn, "cost_analysis") else jax.jit(fn)
  for _ in range(warmup):
    jax.block_until_ready(jitted(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times) if statistic == "median" else np.min(times))


def step_flops(fn: Callable, *args: Any) -> float:
  """FLOPs of one call of `fn(*args)` as XLA's cost analysis of the compiled program counts
  them (0 where the backend reports none). `fn` may be a program already compiled
  (`jax.jit(f).lower(...).compile()`): its analysis is read without compiling again.

  >>> import jax.numpy as jnp
  >>> step_flops(lambda x: x @ x, jnp.ones((8, 8)))  # 8 * 8 * 8 multiply-adds
  1024.0
  """
  if hasattr(fn, "cost_analysis"):  # compiled already
    analysis = fn.cost_analysis()
  else:
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    analysis = jitted.lower(*args).compile().cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
    analysis = analysis[0] if analysis else {}
  return float((analysis or {}).get("flops", 0.0))


def seconds_from_flops(flops: float, peak_flops: float, utilization: float = 1.0) -> float:
  """Compute seconds of a step from its FLOPs, a stated peak (FLOP/s) and the utilisation.

  >>> round(seconds_from_flops(6e12, peak_flops=197e12, utilization=0.5), 6)
  0.060914
  """
  flops = v.number("flops", flops, low=0.0)
  peak_flops = v.number("peak_flops", peak_flops, low=0.0, low_open=True)
  utilization = v.number("utilization", utilization, low=0.0, high=1.0, low_open=True)
  return flops / (peak_flops * utilization)
