"""Failures on the comparison's clock: goodput and time to the target under a failure model.

A trial's failure-free time to the target on a link and its seconds per step are all the
failure model needs (`jaxcomm.sim.simulate_failures`): its run under failures is the same
progress at the method's failure semantics (its module's `failure_semantics`: restart from
a checkpoint, elastic rounds, decoupled learners), over `seeds` failure draws. Per method
and link the report gives the median over training seeds x failure draws of the time to the
target under failures and of the goodput (failure-free time / time under failures), and a
second performance profile over links from those times; its verdict lines say which score
they are about.
"""

from __future__ import annotations

import math

import numpy as np

from jaxcomm import sim

from .. import methods
from . import stats

NONE = "none"


def model(spec: str) -> sim.FailureModel | None:
  """The failure model of `--failures` (None for "none"); ValueError naming the flag.

  >>> model("none") is None, model("llama3").name
  (True, 'llama3')
  """
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"--failures must be 'none', a preset ({', '.join(sim.FAILURE_PRESETS)}) or "
                     f"key=value settings, got {spec!r}.")
  if spec.strip() == NONE:
    return None
  try:
    return sim.failure_model(spec)
  except ValueError as e:
    raise ValueError(f"--failures: {e}") from None


def semantics(settings, replicas: int) -> sim.Semantics:
  """The failure semantics of a method (config.method) with the scenario's `replicas`: its
  module's `failure_semantics` hook (synchronous restart if it declares none).

  >>> from experiments import config
  >>> semantics(config.base_config("diloco").method, 8)[:3]
  ('elastic', 8, 10)
  """
  declared = methods.hooks(settings.name).failure_semantics(settings)
  return declared._replace(units=1 if declared.kind == "restart" else replicas)


def under_failures(time_s: float, step_s: float, semantics: sim.Semantics,
                   failure: sim.FailureModel, devices: int, seeds: int) -> list[float]:
  """A trial's time to the target under failures, one per failure draw (inf stays inf).

  >>> m = sim.failure_model("mtbf_h=1,restart_s=60,detect_s=0,checkpoint_s=10")
  >>> t = under_failures(3600.0, 1.0, sim.Semantics(), m, 1, 3)
  >>> all(x > 3600.0 for x in t)
  True
  """
  if time_s is None or not math.isfinite(time_s):
    return [math.inf] * seeds
  return [float(sim.simulate_failures(failure, devices, semantics, step_s, work_s=time_s,
                                      seed=s).time_to(time_s)[0]) for s in range(seeds)]


def summarise(times: dict, step_s: dict, semantics: dict, failure: sim.FailureModel,
              devices: int, seeds: int, refs: dict) -> dict:
  """Per method and link, under failures: the times (training seeds x failure draws), their
  median, the median goodput, the speed-up over the link's reference (`refs[link]`) with its
  interval over training seeds (each seed's median over the draws) and verdict.

  Args:
    times: {method: {link: [failure-free time to target per training seed (None: missed)]}}.
    step_s: {method: {link: failure-free seconds per step}}.
    semantics: {method: `sim.Semantics`} (with the scenario's replicas filled in).
    failure: the failure model.
    devices: the scenario's devices.
    seeds: failure draws per trial.
    refs: {link: the reference method}.
  """
  out = {}
  for label, links in times.items():
    out[label] = {}
    for link, per_seed in links.items():
      draws = [under_failures(math.inf if t is None else t, step_s[label][link],
                              semantics[label], failure, devices, seeds) for t in per_seed]
      flat = [x for d in draws for x in d]
      goodput = [t / x for t, d in zip(per_seed, draws) for x in d
                 if t is not None and math.isfinite(x)]
      out[label][link] = {
          "seed_times": [stats.median_time(d) for d in draws], "times": flat,
          "median": stats.median_time(flat), "reached": int(np.isfinite(flat).sum()),
          "goodput": float(np.median(goodput)) if goodput else None,
          "semantics": semantics[label].kind}
  for label in out:
    for link in out[label]:
      ref = out[refs[link]][link]["seed_times"]
      s, lo, hi, how = stats.speedup_interval(ref, out[label][link]["seed_times"])
      out[label][link].update(speedup=s, low=lo, high=hi, interval=how,
                              verdict="reference" if label == refs[link]
                              else stats.classify(lo, hi))
  return out


def profile(summary: dict) -> dict:
  """{method: {"profile", "area"}}: the performance profile of the times under failures."""
  curves, areas = stats.profile({m: {n: a["median"] for n, a in links.items()}
                                 for m, links in summary.items()})
  return {m: {"profile": curves[m].tolist(), "area": areas[m]} for m in summary}


def verdict(summary: dict, link: str, reference: str, failure: sim.FailureModel,
            target: float) -> str:
  """One line for `link` about the time to the target under failures (it says so)."""
  ref = summary[reference][link]
  score = f"[time to target under failures, {failure.name}]"
  faster = [(a[link]["speedup"], m) for m, a in summary.items()
            if m != reference and a[link]["verdict"] == stats.FASTER]
  if faster:
    s, best = max(faster)
    a = summary[best][link]
    return (f"{link} {score}: {best} reaches held-out {target:.4f} first: {s:.2f}x sooner "
            f"than {reference} (95 % CI {a['low']:.2f}-{a['high']:.2f}x; goodput "
            f"{a['goodput']:.2f} against {_goodput(ref['goodput'])}).")
  return (f"{link} {score}: no method is distinguishable from {reference} "
          f"(goodput {_goodput(ref['goodput'])}, median {_time(ref['median'])}).")


def rows(summary: dict, link: str) -> list[list[str]]:
  """Table rows of `link`: method, semantics, goodput, time to target, speed-up, interval."""
  out = []
  for m, a in summary.items():
    x = a[link]
    out.append([m, x["semantics"], _goodput(x["goodput"]), _time(x["median"]),
                f"{x['speedup']:.2f}x", f"{x['low']:.2f}-{x['high']:.2f}x"])
  return out


HEADERS = ["method", "semantics", "goodput", "time to target", "vs reference", "95 % CI"]


def _goodput(g) -> str:
  return "-" if g is None else f"{g:.2f}"


def _time(t) -> str:
  return "missed" if t is None or not math.isfinite(t) else f"{t:.1f} s"
