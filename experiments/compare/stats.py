"""The accounting of experiments.compare over seeds and settings (after MLCommons AlgoPerf):
a method's time to the target on a link is the median over seeds (a seed that misses counts
as infinitely slow), its speed-up over the reference comes with a 95 % interval over seeds,
and a method is called faster (or slower) only when that interval excludes 1.

Intervals are paired percentile intervals: a resample draws S seeds with replacement and
applies the same draw to the method and the reference (seed s gives both the same initial
parameters and batches). For S^S <= `EXACT_LIMIT` (S <= 6) every resample is enumerated
(exact); beyond it `BOOTSTRAP` resamples are drawn with a fixed seed. Of the N speed-ups
sorted, the interval runs from the floor(N a/2)-th to the ceil(N (1 - a/2))-th (1-based: the
smallest and largest for S = 3, where N = 27).

Everything here is plain numpy on recorded numbers (nothing trains), so it is tested on
synthetic curves and clocks.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np

EXACT_LIMIT = 50_000
BOOTSTRAP = 10_000
FASTER, SLOWER, SAME = "faster", "slower", "not distinguishable"
TAUS = np.linspace(1.0, 4.0, 301)  # the performance profile's ratios to the fastest


def as_times(times: Sequence) -> np.ndarray:
  """Seconds per seed, a miss (None) as infinity."""
  return np.array([math.inf if t is None else float(t) for t in times], dtype=np.float64)


def median_time(times: Sequence) -> float:
  """The median over seeds of a time to target, a miss counting as infinity (so a method
  that misses on more than half the seeds has an infinite median)."""
  t = as_times(times)
  if t.size == 0:
    raise ValueError("median_time needs at least one seed.")
  return float(np.median(t))


def ratio(reference: float, mine: float) -> float:
  """reference / mine for times that may be infinite: a miss of both is 1 (no difference
  shown), a miss of mine alone 0, of the reference alone infinity."""
  if math.isinf(reference) and math.isinf(mine):
    return 1.0
  if math.isinf(mine):
    return 0.0
  if mine == 0:
    return math.inf
  return reference / mine


def resamples(seeds: int) -> tuple[np.ndarray, str]:
  """Index rows (one resample of `seeds` seeds each) and how they were made."""
  if seeds < 1:
    raise ValueError(f"seeds must be >= 1, got {seeds}.")
  if seeds ** seeds <= EXACT_LIMIT:
    rows = np.array(list(itertools.product(range(seeds), repeat=seeds)), dtype=np.int64)
    return rows, f"exact over all {seeds}^{seeds} = {len(rows)} paired resamples of the seeds"
  rng = np.random.default_rng(0)
  return (rng.integers(0, seeds, size=(BOOTSTRAP, seeds)),
          f"paired bootstrap, {BOOTSTRAP} resamples of the seeds")


def speedup_interval(reference: Sequence, mine: Sequence, confidence: float = 0.95
                     ) -> tuple[float, float, float, str]:
  """(speed-up, low, high, how): median(reference) / median(mine) over the seeds, and its
  `confidence` interval over paired resamples of the seeds (module docstring)."""
  ref, me = as_times(reference), as_times(mine)
  if ref.shape != me.shape or ref.size == 0:
    raise ValueError(f"the reference has {ref.size} seeds and the method {me.size}: they "
                     "must be the same seeds.")
  rows, how = resamples(ref.size)
  values = np.sort([ratio(float(np.median(ref[r])), float(np.median(me[r]))) for r in rows])
  alpha, n = 1 - confidence, len(values)
  lo = values[max(int(math.floor(n * alpha / 2)), 0)]
  hi = values[min(int(math.ceil(n * (1 - alpha / 2))) - 1, n - 1)]
  return ratio(median_time(ref), median_time(me)), float(lo), float(hi), how


def classify(low: float, high: float) -> str:
  """"faster" when the interval lies above 1, "slower" below 1, else not distinguishable."""
  if low > 1:
    return FASTER
  if high < 1:
    return SLOWER
  return SAME


def best_per_study(times: Sequence[Sequence]) -> tuple[np.ndarray, np.ndarray]:
  """The tuned ruleset on one link: `times[setting][study]` (None = miss) -> per study the
  fastest setting's time and that setting's index (the first of equals)."""
  t = np.array([as_times(row) for row in times])
  if t.ndim != 2 or t.size == 0:
    raise ValueError("times must be [settings][studies] with at least one of each.")
  return t.min(axis=0), t.argmin(axis=0)


def higher_median(values: Sequence[float]) -> float:
  """The median, or for an even count the higher of the middle two: the target this gives
  is reached by more than half of the seeds that set it."""
  v = np.sort(np.asarray(values, dtype=np.float64))
  if v.size == 0:
    raise ValueError("higher_median needs at least one value.")
  return float(v[v.size // 2])


def profile(times: dict) -> tuple[dict, dict]:
  """The performance profile over workloads (links): `times[method][link]` (median seconds,
  infinity = miss) -> ({method: rho(tau) on TAUS}, {method: normalised area}). rho(tau) is
  the fraction of links on which the method's time is within tau of the fastest method's;
  the area is the mean of rho over tau in [1, 4] (1: fastest everywhere)."""
  methods = list(times)
  links = list(next(iter(times.values()))) if times else []
  best = {l: min(times[m][l] for m in methods) for l in links}
  curves, areas = {}, {}
  for m in methods:
    r = np.array([times[m][l] / best[l] if math.isfinite(times[m][l]) else math.inf
                  for l in links])
    rho = np.array([(r <= tau).mean() for tau in TAUS]) if links else np.zeros_like(TAUS)
    curves[m] = rho
    areas[m] = float(np.trapezoid(rho, TAUS) / (TAUS[-1] - TAUS[0]))
  return curves, areas


def geometric_mean(speedups: Sequence[float]) -> tuple[float | None, int]:
  """Geometric mean of the finite, positive speed-ups over links, and how many counted (a
  link where the method or the reference misses has no finite speed-up and is left out)."""
  s = np.array([x for x in speedups if x is not None and math.isfinite(x) and x > 0])
  if s.size == 0:
    return None, 0
  return float(np.exp(np.log(s).mean())), int(s.size)
