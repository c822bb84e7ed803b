"""Per-worker compute-time models: how long worker w takes for its j-th gradient.

A time is a pure function of `(key, worker, job)`, so a simulation is reproducible and a
single-device reference can replay exactly the times an SPMD run drew. Parameters are a scalar
(every worker alike) or one value per worker; they are validated when the model is built.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class ComputeModel:
  """Compute times of heterogeneous workers.

  Attributes:
    name: a readable description.
    num_workers: the number of workers the per-worker parameters describe, or None when
      every parameter is a scalar (any number of workers).
    draw: `(key, worker i32[], job i32[]) -> f32[]`, the time of one gradient.
  """
  name: str
  num_workers: int | None
  draw: Callable

  def times(self, key: jax.Array, worker: jax.Array, jobs: jax.Array) -> jax.Array:
    """Times f32[len(jobs)] of `worker`'s jobs numbered `jobs`."""
    return jax.vmap(lambda j: self.draw(key, worker, j))(jobs)

  def table(self, key: jax.Array, num_workers: int, num_jobs: int) -> np.ndarray:
    """Times f32[num_workers, num_jobs] of every worker's first jobs (for references/plots)."""
    self.check(num_workers)
    jobs = jnp.arange(num_jobs)
    return np.asarray(jax.jit(jax.vmap(lambda w: self.times(key, w, jobs)))(
        jnp.arange(num_workers)))

  def check(self, num_workers: int) -> None:
    """Raises ValueError if the per-worker parameters do not describe `num_workers` workers."""
    if self.num_workers is not None and self.num_workers != num_workers:
      raise ValueError(f"compute model {self.name!r} describes {self.num_workers} workers but "
                       f"the simulation has {num_workers}.")


def _per_worker(name: str, value, *, positive: bool = False) -> tuple[np.ndarray, int | None]:
  arr = np.asarray(value, np.float64)
  if arr.ndim > 1 or arr.size == 0:
    raise ValueError(f"{name} must be a scalar or one value per worker, got shape {arr.shape}.")
  if not np.all(np.isfinite(arr)) or np.any(arr < 0) or (positive and np.any(arr <= 0)):
    kind = "> 0" if positive else ">= 0"
    raise ValueError(f"{name} must be finite and {kind} (compute times cannot be negative), "
                     f"got {value!r}.")
  return arr.astype(np.float32).reshape(-1), (arr.size if arr.ndim == 1 else None)


def _workers(*sizes) -> int | None:
  known = {s for s in sizes if s is not None}
  if len(known) > 1:
    raise ValueError(f"per-worker parameters have different lengths {sorted(known)}.")
  return known.pop() if known else None


def _pick(table: np.ndarray, worker: jax.Array) -> jax.Array:
  return jnp.asarray(table)[worker % table.shape[0]] if table.shape[0] > 1 else \
      jnp.asarray(table[0])


def _key(key, worker, job):
  return jax.random.fold_in(jax.random.fold_in(key, worker), job)


def fixed(times) -> ComputeModel:
  """Deterministic times: worker w always takes `times[w]` (or `times` for all).

  >>> fixed([1.0, 1.0, 10.0]).table(jax.random.PRNGKey(0), 3, 2)
  array([[ 1.,  1.],
         [ 1.,  1.],
         [10., 10.]], dtype=float32)
  """
  t, n = _per_worker("times", times)
  return ComputeModel(f"fixed({np.round(t, 3).tolist()})", n,
                      lambda key, w, j: _pick(t, w))


def lognormal(median, sigma) -> ComputeModel:
  """Log-normal times: median_w * exp(sigma_w * N(0, 1)), independent per job.

  >>> m = lognormal(1.0, 0.5)
  >>> bool((m.table(jax.random.PRNGKey(0), 4, 100) > 0).all())
  True
  """
  med, n1 = _per_worker("median", median, positive=True)
  sig, n2 = _per_worker("sigma", sigma)
  return ComputeModel(f"lognormal(median={np.round(med, 3).tolist()}, "
                      f"sigma={np.round(sig, 3).tolist()})", _workers(n1, n2),
                      lambda key, w, j: _pick(med, w) * jnp.exp(
                          _pick(sig, w) * jax.random.normal(_key(key, w, j))))


def heavy_tailed(base, scale, alpha) -> ComputeModel:
  """Heavy-tailed times: base_w + scale_w * Lomax(alpha_w), P(extra > x) = (1 + x/scale)^-alpha.

  With alpha <= 1 the mean is infinite: a worker is now and then stuck for a very long time,
  the regime MindFlayer SGD is designed for.

  >>> m = heavy_tailed(1.0, 0.1, 0.5)
  >>> bool((m.table(jax.random.PRNGKey(0), 4, 100) >= 1.0).all())
  True
  """
  b, n1 = _per_worker("base", base)
  s, n2 = _per_worker("scale", scale)
  a, n3 = _per_worker("alpha", alpha, positive=True)

  def draw(key, w, j):
    u = jax.random.uniform(_key(key, w, j), minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
    return _pick(b, w) + _pick(s, w) * (u ** (-1.0 / _pick(a, w)) - 1.0)

  return ComputeModel(f"heavy_tailed(base={np.round(b, 3).tolist()}, "
                      f"scale={np.round(s, 3).tolist()}, alpha={np.round(a, 3).tolist()})",
                      _workers(n1, n2, n3), draw)
