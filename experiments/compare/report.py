"""What experiments.compare shows a person: per-link tables, one verdict line per link
with its interval and seed count, per-seed times, the compute figures, the sensitivity
lines, the performance profile, `report.md`, `results.json` and the figures, all read from
the method records (`record`) that `compare.run` makes."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from ..reproduce import _reproduce as rep
from . import failures as _failures
from . import figures as _figures
from . import stats
from . import wsd as _wsd

HEADERS = ("method", "bytes/step (mean)", "DP bytes / bytes", "compute/step",
           "time to target (median)", "seeds reached", "speed-up", "95 % CI", "verdict")
# At scale: the bytes each device sends across sites per step (mean) and the step's time
# on the link (compute and the communication its schedule does not hide), from the plans.
SCALE_HEADERS = ("method", "bytes across sites/step", "DP bytes / bytes", "step on the link",
                 *HEADERS[4:])


def _seconds(s: float | None) -> str:
  if s is None or (isinstance(s, float) and math.isinf(s)):
    return "-"
  if s >= 1:
    return f"{s:,.1f} s"
  return f"{s * 1e3:,.1f} ms" if s >= 1e-3 or s == 0 else f"{s * 1e6:,.1f} us"


def _x(v: float | None) -> str:
  if v is None:
    return "-"
  return "inf" if math.isinf(v) else f"{v:.2f}x"


def _link_text(link) -> str:
  gbit = link.bandwidth * 8 / 1e9
  rate = f"{gbit:g} Gbit/s" if gbit >= 1 else f"{gbit * 1e3:g} Mbit/s"
  return f"{rate} per {link.per}, {_seconds(link.latency)} per message"


# ---------------------------------------------------------------- the records
def setting_text(entry: dict, base: dict) -> str:
  """What a tuned setting changes from the method's own entry ("as listed" if nothing)."""
  changed = {k: v for k, v in entry.items() if k != "optimizer" and base.get(k) != v}
  changed.update({f"optimizer.{k}": v for k, v in entry.get("optimizer", {}).items()
                  if base.get("optimizer", {}).get(k) != v})
  return ", ".join(f"{k}={v}" for k, v in changed.items()) or "as listed"


def record(label: str, entries: list, entry: dict, trials: list, accounts: list,
           summary: dict, clock, dp_bytes: float) -> dict:
  """A method's results: its settings, bytes, compute figure, per link the summary over
  studies (`summary.summarise`), and every trial's curve, evaluations and clocks."""
  first = trials[0][0]
  step_bytes = np.concatenate([t.step_bytes for seeds in trials for t in seeds])
  per_step = float(step_bytes.mean()) if step_bytes.size else 0.0
  out = {
      "method": label, "algo": first.config.method.name, "entry": entry,
      "settings": [setting_text(e, entry) for e in entries],
      "settings_full": list(entries), "method_settings": first.config.method.to_dict(),
      "optimizer": first.config.optimizer.to_dict(), "workers": first.trainer.num_workers,
      "overlap_steps": first.overlap, "overlap_backward": first.overlap_backward,
      "population": [seeds[0].population.together for seeds in trials],
      "compute_key": getattr(clock, "keys", {}).get((label, 0)),
      "mesh": first.config.mesh, "replicas": replicas(first.population.runs[0]),
      "compute_seconds_per_step": clock.seconds(first),
      "wire_bytes_per_step": per_step, "dp_wire_bytes_per_step": dp_bytes,
      "compression_ratio": dp_bytes / per_step if per_step else None,
      "inspected_wire_bytes": {"every_step": first.report.wire_bytes(conditional=False),
                               "conditional": first.report.wire_bytes(conditional=True)},
      "links": summary, "trials": []}
  for k, seeds in enumerate(trials):
    for s, t in enumerate(seeds):
      timelines = t.clocks(clock)
      steps, losses = (list(v) for v in zip(*t.evals)) if t.evals else ([], [])
      out["trials"].append({
          "setting": k, "seed": s, "trained_steps": len(t.history),
          "train_seconds_emulated": t.seconds,
          "curve": {"step": [r["step"] for r in t.history],
                    "loss": [r["loss"] for r in t.history],
                    "wire_bytes": t.step_bytes.tolist()},
          "evals": {"step": steps, "heldout_loss": losses},
          "links": {n: {**accounts[k][s][n], "time": tl.known.tolist(),
                        "eval_steps": t.evals_on(n)[0].tolist(),
                        "comm_seconds": tl.comm_seconds.tolist()}
                    for n, tl in timelines.items()}})
  return out


def replicas(run) -> int:
  """How many replicas a run's method synchronises (the product of its method axes)."""
  axes = run.method_axes if isinstance(run.method_axes, tuple) else (run.method_axes,)
  return math.prod(run.mesh.shape[a] for a in axes if a)


def _across(r: dict) -> float:
  return sum(b for a, b in r["scale"]["bytes_per_axis"].items() if "replica" in a.split(","))


def headers(records: list) -> tuple:
  """HEADERS, or SCALE_HEADERS when the records carry their plans at scale."""
  return SCALE_HEADERS if records and records[0].get("scale") else HEADERS


def rows(records: list, link: str) -> list:
  """One row per method on `link`: `headers(records)`' cells, as text."""
  out = []
  dp = next((r for r in records if r.get("scale") and r["algo"] == "dp"
             and not r["method_settings"].get("dtype")), None)
  for r in records:
    a = r["links"][link]
    seeds = len(a["study_times"])
    if r.get("scale"):
      across = _across(r)
      cells = [f"{across:,.0f}", _x(_across(dp) / across) if dp and across else "-",
               _seconds(r["scale"]["links"][link]["step"])]
    else:
      cells = [f"{r['wire_bytes_per_step']:,.0f}", _x(r["compression_ratio"]),
               _seconds(r["compute_seconds_per_step"])]
    time = a["median"]
    out.append([r["method"], *cells,
                _seconds(time) if math.isfinite(time) else a.get("status", "not reached"),
                f"{a['reached']}/{seeds}", _x(a["speedup"]),
                f"{a['low']:.2f}-{a['high']:.2f}x", a["verdict"]])
  return out


def seed_rows(records: list, link: str) -> list:
  """Per method on `link`: each study's time to the target (and the setting it chose)."""
  out = []
  for r in records:
    a = r["links"][link]
    cells = []
    for t, k in zip(a["study_times"], a["chosen_setting"]):
      cell = _seconds(t) if t is not None else "miss"
      cells.append(cell + (f" ({r['settings'][k]})" if len(r["settings"]) > 1 else ""))
    out.append([r["method"], *cells])
  return out


def aligned(headers, table_rows) -> str:
  """A fixed-width text table: the first column left-aligned, the others right-aligned."""
  widths = [max(len(str(x)) for x in col) for col in zip(headers, *table_rows)]
  def line(cells):
    return "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w)
                     for i, (x, w) in enumerate(zip(cells, widths)))
  return "\n".join([line(headers), "-" * len(line(headers))] + [line(r) for r in table_rows])


# ---------------------------------------------------------------- verdicts
def reference_on(summary: dict, link: str, reference: str) -> str:
  """The label that stands as the reference on `link` (its verdict says "reference"), or
  `reference` when no summary names one."""
  named = [m for m, a in summary.items() if a[link].get("verdict") == "reference"]
  return named[0] if named else reference


def _ci(a: dict) -> str:
  return f"95 % CI {a['low']:.2f}-{a['high']:.2f}x"


def verdict(summary: dict, link: str, reference: str, target: float,
            budget: float | None = None) -> str:
  """One line for `link`: the method that reaches the target first by a speed-up whose 95 %
  interval lies above 1 (with the interval and its seeds); or, when the next fastest cannot
  be told apart from it (the interval of their ratio contains 1, `stats.tied`; a miss
  counted as `budget`), every method tied with it; or that no method is distinguishable
  from the reference there (the link's own, `reference_on`). `summary[label][link]` as
  `summary.summarise`."""
  reference = reference_on(summary, link, reference)
  ref = summary[reference][link]
  seeds = len(ref["study_times"])
  others = {m: a[link] for m, a in summary.items() if m != reference}
  faster = [(a["speedup"], m) for m, a in others.items() if a["verdict"] == stats.FASTER]
  if faster:
    s, best = max(faster)
    a = others[best]
    tied = stats.tied({m: x["study_times"] for m, x in others.items()}, best, budget)
    if len(tied) > 1:
      rest = []
      for m in tied[1:]:
        r, lo, hi, _ = stats.speedup_interval(others[m]["study_times"], a["study_times"],
                                              censor=budget)
        rest.append(f"{m} {others[m]['speedup']:.2f}x ({_ci(others[m])}; {best} / {m}: "
                    f"{r:.2f}x, 95 % CI {lo:.2f}-{hi:.2f}x)")
      return (f"{link}: {' and '.join([', '.join(tied[:-1]), tied[-1]])} tie for first (the "
              f"interval of their ratio contains 1): {best} reaches held-out {target:.4f} "
              f"{s:.2f}x sooner than {reference} ({_ci(a)}, {a['reached']}/{seeds} seeds), "
              + ", ".join(rest) + ".")
    return (f"{link}: {best} reaches held-out {target:.4f} first: {s:.2f}x sooner than "
            f"{reference} ({_ci(a)}, {a['reached']}/{seeds} seeds).")
  tail = ""
  if others:
    s, m = max((a["speedup"], m) for m, a in others.items())
    a = others[m]
    tail = f"; best other: {m} {_x(s)} ({_ci(a)}, {a['reached']}/{seeds} seeds)"
  return (f"{link}: no method is distinguishable from {reference} here ({reference} reaches "
          f"held-out {target:.4f} in {_seconds(ref['median'])}, {ref['reached']}/{seeds} "
          f"seeds{tail}).")


def sensitivity_line(sensitivity: dict, link: str, reference: str) -> str:
  """How the verdict on `link` moves when every compute figure is 20 % smaller or larger."""
  parts = []
  for scale, summary in sorted(sensitivity.items()):
    reference = reference_on(summary, link, reference)
    faster = [(a[link]["speedup"], m) for m, a in summary.items()
              if m != reference and a[link]["verdict"] == stats.FASTER]
    if faster:
      s, m = max(faster)
      a = summary[m][link]
      text = f"{m} {s:.2f}x (95 % CI {a['low']:.2f}-{a['high']:.2f}x)"
    else:
      text = f"none distinguishable from {reference}"
    parts.append(f"compute {(scale - 1) * 100:+.0f} %: {text}")
  return f"{link}: " + "; ".join(parts)


def scores(records: list, links: list) -> dict:
  """Per method: the performance profile over links (rho on stats.TAUS), its normalised
  area, and the geometric mean over links of the median speed-up (links where either side
  misses left out, counted)."""
  times = {r["method"]: {n: r["links"][n]["median"] for n in links} for r in records}
  curves, areas = stats.profile(times)
  out = {}
  for r in records:
    g, k = stats.geometric_mean([r["links"][n]["speedup"] for n in links])
    out[r["method"]] = {"profile": curves[r["method"]].tolist(), "area": areas[r["method"]],
                        "geomean_speedup": g, "geomean_links": k}
  return out


# ---------------------------------------------------------------- text and markdown
def _heading(config, records: list, target: float, source: str) -> str:
  c, m = config.compare, config.model
  return (f"{len(records)} methods on {records[0]['workers']} workers; LM d_model={m.d_model} "
          f"layers={m.num_layers} on {config.data.name} ({config.data.split} split; batch "
          f"{config.data.batch_size} x {config.data.seq_len}). {c.ruleset} ruleset, "
          f"{c.seeds} seeds, {schedule_text(c)}. Target: held-out loss {target:.4f} "
          f"({source}; evaluated on {c.eval_batch} test sequences, untimed, {_readings(c)}). "
          f"Reference on each link: the fastest of "
          f"{', '.join(c.get('reference_pool', (c.reference,)))}; budget: its median time "
          f"to the target there x {c.budget:g}; at most {c.max_steps} steps per trial.")


def _readings(c) -> str:
  """When the held-out loss is read (trials.Population.evaluate_on), in words."""
  if c.get("scale") == "scenario":
    return (f"every {c.eval_every} steps, at step 0 and at the step cap: the steps to the "
            "target are the proxy's, the same on every link")
  return (f"at fixed intervals of simulated time on each link ({c.reference}'s time for "
          f"{c.eval_every} steps there) and every {c.eval_every} steps")


def schedule_text(c) -> str:
  """Which learning-rate schedule ran (config.compare.schedule), in words."""
  if c.get("schedule", "constant") == "constant":
    return "constant learning rate"
  if c.schedule == "wsd":
    return (f"warmup-stable-decay (warmup {c.warmup_steps} steps; the trials are the stable "
            f"phase, a decay over the last {c.decay_fraction:g} of each budget branches per "
            "link)")
  return (f"schedule-free inner optimiser (warmup {c.warmup_steps} steps; held-out loss at "
          "its evaluation parameters)")


def _link_heading(name: str, link, budget: float, reference: str = "") -> str:
  return (f"{name} ({_link_text(link)}): budget {_seconds(budget)}"
          + (f", reference {reference}" if reference else ""))


def text(config, links: dict, budgets: dict, target: float, source: str, records: list,
         summary: dict, scale: dict | None = None, under_failures: dict | None = None
         ) -> tuple[str, list]:
  """The terminal text (heading, a table per link, the verdicts) and the verdict lines;
  `scale`: scale_report.text's lines (the scenario, the proxy's own clock); `under_failures`: the
  second score (failures.extra)."""
  c = config.compare
  parts = ([scale["top"], ""] if scale else []) + [_heading(config, records, target, source)]
  for name, link in links.items():
    ref = reference_on(summary, name, c.reference)
    parts.append(f"\n{_link_heading(name, link, budgets[name], ref)}\n"
                 + aligned(headers(records), rows(records, name)))
  verdicts = [verdict(summary, n, c.reference, target, budgets[n]) for n in links]
  where = " at the scenario's scale" if scale else ""
  parts.append(f"\nVerdict{where} (time to the held-out target on each link, median over "
               "seeds):\n" + "\n".join(f"  {v}" for v in verdicts))
  if scale:
    parts.append("\n" + scale["bottom"])
  if under_failures:
    parts.append("\nUnder failures (median over seeds and failure draws):\n"
                 + "\n".join(f"  {v}" for v in under_failures["verdicts"]))
  return "\n".join(parts), verdicts


def markdown(config, links: dict, budgets: dict, target: float, source: str, records: list,
             verdicts: list, extra: dict, score: dict, plots: list, command: str | None
             ) -> str:
  """report.md."""
  c = config.compare
  interval = records[0]["links"][next(iter(links))]["interval"]
  scale = extra.get("scale_sections")
  clock = ("Time is simulated at the scenario's scale (above)" if scale else
           "Time is simulated: one measured compute figure per local step plus the "
           "communication of each method's compiled step on the link")
  sections = [
      "# Which method reaches the held-out target first, on each link",
      *([scale["top"]] if scale else []),
      _heading(config, records, target, source),
      f"{clock}, less what its schedule overlaps (later steps, or the backward pass bucket "
      f"by bucket: \"overlap\" below). The held-out loss is read {_readings(c)}; the steps "
      "to the target are interpolated between the two readings around it (the loss linear in "
      "steps between them) and the time is the clock there. A method's time is the median "
      "over seeds of its time to the target, a miss counting as infinity; its speed-up over "
      f"the reference is the geometric mean of the paired per-seed speed-ups, with {interval}. "
      "A verdict says \"faster\" only when the interval lies above 1, and names the first "
      "two as tied when the interval of their ratio contains 1.",
      "## Verdict\n\n" + "\n".join(f"* {v}" for v in verdicts),
      *([scale["proxy"]] if scale else [])]
  for name, link in links.items():
    ref = reference_on({r["method"]: r["links"] for r in records}, name, c.reference)
    sections.append(f"## {_link_heading(name, link, budgets[name], ref)}\n\n"
                    + rep.markdown_table(headers(records), rows(records, name))
                    + "\n\nPer seed (study), time to the target:\n\n"
                    + rep.markdown_table(["method"] + [f"seed {s}" for s in range(c.seeds)],
                                         seed_rows(records, name)))
  if extra.get("wsd"):
    sections.append(_wsd.markdown(extra["wsd"], list(links), _first(records, links),
                                  c.decay_fraction, rep.markdown_table))
  sections.append("## Sensitivity to the compute figure\n\nEvery compute figure 20 % smaller "
                  "and larger (the budgets follow the reference; from the steps trained):\n\n"
                  + "\n".join(f"* {sensitivity_line(extra['sensitivity'], n, c.reference)}"
                              for n in links))
  if scale:
    sections.append(scale["steps"])
  else:
    sections.append(_compute_section(extra))
  sections.append(_failures.markdown(extra.get("failures"), c.failures, list(links)))
  sections.append("## Score over all links\n\n" + rep.markdown_table(
      ["method", "profile area", "geometric-mean speed-up", "links counted"],
      [[m, f"{s['area']:.3f}", _x(s["geomean_speedup"]), str(s["geomean_links"])]
       for m, s in score.items()])
      + "\n\nProfile: per link the ratio of a method's median time to the fastest method's; "
      "rho(tau) = fraction of links within tau, tau in [1, 4]; area = mean of rho (1: "
      "fastest everywhere). Geometric mean over the links where both the method and the "
      "reference reach the target, of the median speed-up over each link's reference.")
  return _tail(sections, config, links, records, extra, plots, command)


def _compute_section(extra: dict) -> str:
  """The proxy's measured compute figures (config.compare.scale="proxy")."""
  return ("## Compute per local step\n\n" + rep.markdown_table(
      ["local step", "median", "min", "max", "repeats", "forward / backward / update",
       "methods"],
      [[k, _seconds(v["seconds"]), _seconds(v["min"]), _seconds(v["max"]),
        str(v["repeats"]), "{forward:.2f} / {backward:.2f} / {update:.2f}".format(
            **extra["shares"][k]),
        ", ".join(sorted({lk.split("#")[0] for lk, key in extra["keys"].items() if key == k}))]
       for k, v in extra["compute"].items()])
      + "\n\nTimed in interleaved rounds (one call of each per round). Shares of the step "
      f"from {next(iter(extra['shares'].values()))['source']}.")


def _tail(sections, config, links, records, extra, plots, command) -> str:
  """report.md's last sections (links, figures, settings) after `sections`."""
  sections.append("## Links\n\n" + rep.markdown_table(
      ["link", "bandwidth, latency", "source"],
      [[n, _link_text(l), l.source or "-"] for n, l in links.items()]))
  sections.append("## Figures\n\n" + "\n\n".join(
      f"![{os.path.splitext(os.path.basename(p))[0]}]({os.path.basename(p)})" for p in plots))
  settings = [[r["method"], r["algo"], _settings_text(r["entry"]), "; ".join(r["settings"]),
               str(r["overlap_steps"]), "yes" if r["overlap_backward"] else "no",
               "one program" if all(r["population"]) else "one after the other"]
              for r in records]
  sections.append("## Settings\n\n" + rep.markdown_table(
      ["method", "module", "entry", "settings run", "overlap steps", "overlap backward",
       "seeds"],
      settings) + "\n\nShared: " + _settings_text(
          {"steps": config.steps, "seed": config.seed, "mesh": config.mesh or "data=all",
           "model": config.model.to_dict(), "data": config.data.to_dict(),
           "optimizer": config.optimizer.to_dict(), "compare": config.compare.to_dict()})
                  + f"\n\nWall time {extra['wall_seconds']:.0f} s."
                  + (f"\n\nCommand: `{command}`" if command else ""))
  return "\n\n".join(sections) + "\n"


def _first(records: list, links) -> dict:
  """Per link the method with the lowest median time to the target."""
  return {n: min(records, key=lambda r, n=n: r["links"][n]["median"])["method"]
          for n in links}


def _settings_text(settings: dict) -> str:
  return ", ".join(f"{k}={v}" for k, v in settings.items() if k != "name" and v is not None)


def write(config, workdir: str, links: dict, budgets: dict, target: float, source: str,
          records: list, extra: dict, command: str | None = None) -> dict:
  """Writes the figures, report.md and results.json into `workdir`; returns the summary
  (what results.json holds, with the terminal text under "text")."""
  os.makedirs(workdir, exist_ok=True)
  summary = {r["method"]: r["links"] for r in records}
  printed, verdicts = text(config, links, budgets, target, source, records, summary,
                           extra.get("scale_text"), extra.get("failures"))
  if extra.get("wsd"):
    printed += ("\n\nWarmup-stable-decay (held-out loss at the budget, median over seeds):\n"
                + "\n".join(f"  {x}" for x in _wsd.lines(extra["wsd"]["summary"], list(links),
                                                         _first(records, links))))
  score = scores(records, list(links))
  plots = _figures.plot(records, config, links, budgets, target, score, workdir)
  path = os.path.join(workdir, "report.md")
  with open(path, "w", encoding="utf-8") as f:
    f.write(markdown(config, links, budgets, target, source, records, verdicts, extra, score,
                     plots, command))
  sensitivity = [sensitivity_line(extra["sensitivity"], n, config.compare.reference)
                 for n in links]
  out = {
      "config": config.to_dict(), "reference": config.compare.reference,
      "ruleset": config.compare.ruleset, "seeds": config.compare.seeds,
      "schedule": config.compare.get("schedule", "constant"),
      "target_loss": target, "target_source": source,
      "links": {n: {"bandwidth": l.bandwidth, "latency": l.latency, "source": l.source,
                    "budget_seconds": budgets[n], "reference": extra["references"][n],
                    "eval_interval_seconds": extra["intervals"][n]}
                for n, l in links.items()},
      "compute": extra["compute"], "compute_shares": extra["shares"],
      "compute_keys": extra["keys"], "reference_setting": extra["reference_setting"],
      "wall_seconds": extra["wall_seconds"], "scores": score, "methods": records,
      "wsd": extra.get("wsd"), "scale": extra.get("scale"), "failures": extra.get("failures"),
      "proxy_clock": ({"verdicts": extra["scale_text"]["proxy_verdicts"],
                       "budgets": extra["proxy_clock"]["budgets"],
                       "references": extra["proxy_clock"]["references"],
                       "methods": {m: {n: {k: a[k] for k in ("median", "speedup", "low", "high",
                                                             "verdict", "study_times")}
                                       for n, a in per.items()}
                                   for m, per in extra["proxy_clock"]["summary"].items()}}
                      if extra.get("scale_text") else None),
      "not_planned": extra.get("not_planned") or {}, "proxy_mesh": config.mesh,
      "text": printed, "verdicts": verdicts, "sensitivity": sensitivity, "plots": plots,
      "report": path, "command": command}
  with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1, default=_json)
  return out


def _json(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"not JSON: {type(x)}")
