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

import ml_collections
import numpy as np

from jaxcomm import sim

from .. import methods
from ..reproduce import _reproduce as rep
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
    raise ValueError(f"--failures: {str(e).removeprefix('failures: ')}") from None


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
          "semantics": semantics[label].kind, "units": semantics[label].units,
          "step_seconds": step_s[label][link]}
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


def extra(records: list, links: list, spec: str, draws: int, devices: int, refs: dict,
          target: float) -> dict | None:
  """What `compare.run` adds under `--failures` (None for "none"): {"model", "draws",
  "devices", "summary", "profile", "verdicts"}, from the records of the failure-free run:
  per method its per-seed times to the target, its seconds per step on each link (the mean
  over its first trial's steps) and its module's semantics over its replicas."""
  failure = model(spec)
  if failure is None:
    return None
  times = {r["method"]: {n: r["links"][n]["study_times"] for n in links} for r in records}
  step_s = {r["method"]: {n: _seconds_per_step(r["trials"][0]["links"][n]["time"])
                          for n in links} for r in records}
  declared = {r["method"]: semantics(ml_collections.ConfigDict(r["method_settings"]),
                                     r["replicas"]) for r in records}
  summary = summarise(times, step_s, declared, failure, devices, draws, refs)
  return {"model": failure._asdict(), "draws": draws, "devices": devices,
          "summary": summary, "profile": profile(summary),
          "verdicts": [verdict(summary, n, refs[n], failure, target) for n in links]}


def markdown(found: dict | None, spec: str, links: list) -> str:
  """report.md's section on failures: the model, per link the table and the verdict, the
  profile's areas; or, without a model, the line saying so."""
  if found is None:
    return (f"## Under failures\n\n`--failures={spec}` (the default): nothing fails. "
            f"`--failures=<preset>` ({', '.join(p for p in sim.FAILURE_PRESETS if p != NONE)}) "
            "or `--failures=mtbf_h=...,restart_s=...` adds each method's time to the target "
            "and goodput under that failure model, and a second performance profile.")
  m = found["model"]
  parts = [f"## Under failures: {m['name']}\n\nThe failure-free runs above, with devices "
           f"failing at a mean time between failures of {m['mtbf_h']:g} h each "
           f"({found['devices']} devices; restart {m['restart_s']:g} s, checkpoint save "
           f"{m['checkpoint_s']:g} s, restore {m['restore_s']:g} s, detection "
           f"{m['detect_s']:g} s; `jaxcomm.sim.simulate_failures`, {found['draws']} seeded "
           "draws per training seed). Each method behaves as its module declares "
           "(`failure_semantics`: restart from the last checkpoint, elastic rounds without "
           "the failed replica, or decoupled learners). Goodput = failure-free time / time "
           "under failures; times are medians over training seeds x failure draws, the "
           "interval over training seeds (each its median over the draws).",
           "\n".join(f"* {v}" for v in found["verdicts"])]
  for n in links:
    parts.append(f"### {n}\n\n" + rep.markdown_table(HEADERS, rows(found["summary"], n)))
  parts.append("Performance profile of the times under failures (area: 1 is fastest on "
               "every link): " + ", ".join(f"{k} {v['area']:.3f}"
                                           for k, v in found["profile"].items()) + ".")
  return "\n\n".join(parts)


def _seconds_per_step(known: list) -> float:
  """Seconds per step of a timeline's `known` times (its duration over its steps)."""
  return float(known[-1]) / len(known) if known else 0.0


HEADERS = ["method", "semantics", "goodput", "time to target", "vs reference", "95 % CI"]


def _goodput(g) -> str:
  return "-" if g is None else f"{g:.2f}"


def _time(t) -> str:
  return "missed" if t is None or not math.isfinite(t) else f"{t:.1f} s"
