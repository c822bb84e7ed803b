"""The comparison's intervals hold their stated level: the whole procedure (paired seeds, a
time per seed, the interval, the verdict) simulated on synthetic seeds with a known speed-up.

The times of seed s are log-normal around the method's true time (the method and the
reference with independent noise of 5-20 %, as a seed's time to the target varies); the
interval (`_compare_stats.speedup_interval`'s t-interval on the paired log speed-ups) must
contain the true speed-up in 0.92-0.98 of 600 seeded repetitions at its nominal 0.95, at the
default 3 seeds and at 5; and two equal methods must be called "faster" (or "slower") in at
most the 2.5 % (+ the simulation's noise) the level allows. Vectorised: well under a second.
"""

import numpy as np
import pytest

from experiments.compare import stats

REPS = 600


def _simulate(seeds, noise, speedup, rng):
  """(reference, method) times f64[REPS, seeds]: log-normal around 10 s and 10 s / speedup."""
  ref = 10.0 * np.exp(rng.normal(0.0, noise, (REPS, seeds)))
  mine = 10.0 / speedup * np.exp(rng.normal(0.0, noise, (REPS, seeds)))
  return ref, mine


@pytest.mark.parametrize("seeds", [3, 5])
@pytest.mark.parametrize("noise", [0.05, 0.1, 0.2])
def test_the_95_interval_covers_the_true_speedup_95_percent_of_the_time(seeds, noise):
  rng = np.random.default_rng(1000 * seeds + int(100 * noise))
  ref, mine = _simulate(seeds, noise, 2.0, rng)
  _, lo, hi = stats.log_interval(np.log(ref) - np.log(mine), 0.95)
  coverage = np.mean((lo <= 2.0) & (2.0 <= hi))
  assert 0.92 <= coverage <= 0.98, coverage
  # The per-call function (what the summary calls) gives the same interval.
  one = stats.speedup_interval(ref[0].tolist(), mine[0].tolist())
  assert one[1:3] == pytest.approx((lo[0], hi[0]))
  assert "t-interval on the paired log speed-ups" in one[3]


def test_equal_methods_are_rarely_called_faster_or_slower():
  rng = np.random.default_rng(7)
  ref, mine = _simulate(3, 0.1, 1.0, rng)
  _, lo, hi = stats.log_interval(np.log(ref) - np.log(mine), 0.95)
  assert np.mean(lo > 1) <= 0.025 + 0.02 and np.mean(hi < 1) <= 0.025 + 0.02
  # and a true 2x at 10 % noise is found faster on almost every repetition at 3 seeds
  ref, mine = _simulate(3, 0.1, 2.0, rng)
  _, lo, _ = stats.log_interval(np.log(ref) - np.log(mine), 0.95)
  assert np.mean(lo > 1) > 0.95


def test_the_t_quantiles_are_the_tables():
  # Student's t, two-sided 95 %: 12.706 (1), 4.303 (2), 2.776 (4), 2.262 (9), 1.960 (inf)
  assert [round(stats.t_quantile(0.975, df), 3) for df in (1, 2, 4, 9)] == \
      [12.706, 4.303, 2.776, 2.262]
  assert abs(stats.t_quantile(0.975, 10_000) - 1.960) < 1e-3


def test_ties_and_misses():
  # Paired speed-ups 2.5, 2.4, 1.75: geometric mean 2.19, t_2 = 4.303 -> 1.35-3.56x.
  s, lo, hi, _ = stats.speedup_interval([10.0, 12.0, 14.0], [4.0, 5.0, 8.0])
  assert (round(s, 3), round(lo, 3), round(hi, 3)) == (2.19, 1.348, 3.556)
  # A miss counts as the budget (20 s): ratios 2.5, 0.6, 1.75.
  s, lo, hi, how = stats.speedup_interval([10.0, 12.0, 14.0], [4.0, None, 8.0], censor=20.0)
  assert s == pytest.approx((2.5 * 0.6 * 1.75) ** (1 / 3)) and lo < 1 < hi
  assert "a miss counted as the budget" in how
  # Without a budget a miss leaves the interval open; both missing is a tie.
  assert stats.speedup_interval([10.0], [None])[1:3] == (0.0, float("inf"))
  assert stats.speedup_interval([None, None], [None, None])[:3] == (1.0, 1.0, 1.0)
  times = {"a": [5.0, 6.0, 7.0], "b": [5.1, 5.9, 7.2], "c": [9.0, 10.0, 12.0]}
  assert stats.tied(times, "a") == ["a", "b"]
