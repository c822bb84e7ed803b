"""The accounting of experiments.compare over seeds and settings (after MLCommons AlgoPerf):
a method's time to the target on a link is the median over seeds (a seed that misses counts
as infinitely slow), its speed-up over the reference comes with a 95 % interval over seeds,
and a method is called faster (or slower) only when that interval excludes 1.

The interval is a t-interval on the paired log speed-ups: seed s gives the method and the
reference the same initial parameters and batches, d_s = log(t_ref,s / t_s), and with S
seeds the interval is exp(mean(d) -+ t_{S-1, 1-a/2} sd(d) / sqrt(S)) around the geometric
mean of the paired speed-ups exp(mean(d)). Under log-normal noise of the times it holds its
level at any S >= 2 (`tests/test_compare_stats.py` simulates the whole procedure and
measures it); the percentile interval over the S^S paired resamples it replaces is roughly
the range of the S ratios, whose coverage is about 1 - 2 (1/2)^S (0.75 at S = 3). A seed
that misses the target counts as the link's budget (`censor`): its true time is later, so
the method's speed-up there is at most what is counted. Two methods whose ratio's interval
contains 1 are tied (`tied`).

Everything here is plain numpy on recorded numbers (nothing trains), so it is tested on
synthetic curves and clocks.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

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


def t_quantile(p: float, df: int) -> float:
  """The p-quantile (p >= 0.5) of Student's t with `df` degrees of freedom (SciPy's
  `stdtrit`; a dependency, as for JAX).

  >>> round(t_quantile(0.975, 2), 4), round(t_quantile(0.975, 4), 4)
  (4.3027, 2.7764)
  """
  if not 0.5 <= p < 1 or df < 1:
    raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}.")
  from scipy import special  # here: programs that import this module need not load SciPy
  return float(special.stdtrit(df, p))


def log_interval(d: np.ndarray, confidence: float = 0.95) -> tuple:
  """(exp(mean), low, high) of the t-interval on log ratios `d` (last axis: the seeds; any
  leading axes are independent cases, for simulations). One seed: no interval (0, inf)."""
  d = np.asarray(d, dtype=np.float64)
  s = d.shape[-1]
  mean = d.mean(axis=-1)
  if s < 2:
    return np.exp(mean), np.zeros_like(mean), np.full_like(mean, np.inf)
  half = t_quantile(1 - (1 - confidence) / 2, s - 1) * d.std(axis=-1, ddof=1) / math.sqrt(s)
  return np.exp(mean), np.exp(mean - half), np.exp(mean + half)


def speedup_interval(reference: Sequence, mine: Sequence, confidence: float = 0.95,
                     censor: float | None = None) -> tuple[float, float, float, str]:
  """(speed-up, low, high, how): the geometric mean over seeds of the paired speed-ups
  t_ref,s / t_s and its `confidence` t-interval (module docstring). A miss counts as
  `censor` (the budget); without one, a pair with a miss leaves the interval open
  (0 and infinity), and a pair that both miss counts as a tie."""
  ref, me = as_times(reference), as_times(mine)
  if ref.shape != me.shape or ref.size == 0:
    raise ValueError(f"the reference has {ref.size} seeds and the method {me.size}: they "
                     "must be the same seeds.")
  how = (f"a {confidence * 100:g} % t-interval on the paired log speed-ups over {ref.size} seeds "
         f"({ref.size - 1} degree{'s' if ref.size != 2 else ''} of freedom)")
  if censor is not None:
    ref, me = np.minimum(ref, censor), np.minimum(me, censor)
    how += ", a miss counted as the budget"
  both = np.isinf(ref) & np.isinf(me)
  ref, me = np.where(both, 1.0, ref), np.where(both, 1.0, me)
  if not (np.all(np.isfinite(ref)) and np.all(np.isfinite(me))):
    return ratio(median_time(ref), median_time(me)), 0.0, math.inf, how
  point, lo, hi = log_interval(np.log(ref) - np.log(me), confidence)
  return float(point), float(lo), float(hi), how


def classify(low: float, high: float) -> str:
  """"faster" when the interval lies above 1, "slower" below 1, else not distinguishable."""
  if low > 1:
    return FASTER
  if high < 1:
    return SLOWER
  return SAME


def tied(times: dict, leader: str, censor: float | None = None,
         confidence: float = 0.95) -> list:
  """The labels of `times` ({label: per-seed times}) that cannot be told apart from
  `leader`: the interval of leader's speed-up over each contains 1 (the leader first)."""
  out = [leader]
  for label, t in times.items():
    if label != leader:
      _, lo, hi, _ = speedup_interval(t, times[leader], confidence, censor)
      if classify(lo, hi) == SAME:
        out.append(label)
  return out


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
