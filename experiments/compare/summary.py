"""Reading experiments.compare's trials: the reference's tuned setting, per link every
method's time over studies (the fastest setting per study), its median, its speed-up over
the reference with an interval and a verdict, and exact DP's bytes per step for ratios."""

from __future__ import annotations

import math

import numpy as np

from .. import build
from . import stats
from .clock import Clock
from .settings import method_config
from .trials import inspect_only


def exact_dp_bytes(config, trials: dict) -> float:
  """Wire bytes per step of exact (f32) DP on this mesh, read from its compiled step: the
  trained `dp` trial's, or a DP step compiled for the purpose."""
  for ts in trials.values():
    t = ts[0][0]
    if t.config.method.name == "dp" and not t.config.method.get("dtype"):
      return float(t.report.wire_bytes(conditional=False))
  run = build.build(method_config(config, {"method": "dp"}))
  trainer = run.trainer()
  state = trainer.init(run.params)
  batch = trainer.shard_batch(run.batches(0))
  return float(inspect_only(trainer.step_fn(state, batch), state, batch, run.mesh).wire_bytes())


def reference_setting(trials: list, steps: int) -> tuple[int, list]:
  """The reference's tuned setting (the lowest median over seeds of its best held-out loss
  in `steps` steps) and that setting's best held-out loss per seed."""
  bests = [[min(loss for s, loss in t.evals if s <= steps) for t in seeds] for seeds in trials]
  k = int(np.argmin([np.median(b) for b in bests]))
  return k, bests[k]


def pool(config, labels) -> list:
  """The labels that may stand as the reference (config.compare.reference_pool, those that
  run), `config.compare.reference` among them."""
  c = config.compare
  return [c.reference] + [x for x in c.get("reference_pool", ()) if x in labels
                          and x != c.reference]


def budgets_and_references(trials: dict, clock: Clock, target: float, config
                           ) -> tuple[dict, dict]:
  """Per link, the reference (of `pool`, at its tuned setting: the lowest median time to
  the target with no budget; ties go to the first) and the budget: `config.compare.budget`
  times its median time."""
  c = config.compare
  unbounded = {m: math.inf for m in clock.links}
  medians = {}
  for label in pool(config, trials):
    k = reference_setting(trials[label], config.steps)[0]
    accounts = [t.accounts(clock, unbounded, target, c.max_steps) for t in trials[label][k]]
    medians[label] = {n: stats.median_time([a[n]["time_to_target"] for a in accounts])
                      for n in clock.links}
  refs = {n: min(medians, key=lambda m, n=n: medians[m][n]) for n in clock.links}
  return {n: c.budget * medians[refs[n]][n] for n in clock.links}, refs


def summarise(trials: dict, clock: Clock, target: float, config, budgets=None,
              refs=None) -> tuple:
  """(budgets, per-method summary, accounts): per link each method's per-study times (the
  fastest setting per study), median, speed-up over that link's reference (`refs`, or
  `budgets_and_references`) with its interval and verdict."""
  c = config.compare
  if refs is None:
    found, refs = budgets_and_references(trials, clock, target, config)
    budgets = found if budgets is None else budgets
  accounts = {label: [[t.accounts(clock, budgets, target, c.max_steps) for t in seeds]
                      for seeds in ts] for label, ts in trials.items()}
  out = {}
  for label, per_setting in accounts.items():
    out[label] = {}
    for n in clock.links:
      best, chosen = stats.best_per_study([[a[n]["time_to_target"] for a in seeds]
                                           for seeds in per_setting])
      out[label][n] = {"study_times": [None if math.isinf(x) else float(x) for x in best],
                       "chosen_setting": chosen.tolist(), "median": stats.median_time(best),
                       "reached": int(np.isfinite(best).sum()), "reference": refs[n]}
  for label in out:
    for n in clock.links:
      s, lo, hi, how = stats.speedup_interval(out[refs[n]][n]["study_times"],
                                              out[label][n]["study_times"])
      out[label][n].update(speedup=s, low=lo, high=hi, interval=how,
                           verdict="reference" if label == refs[n]
                           else stats.classify(lo, hi))
  return budgets, out, accounts
