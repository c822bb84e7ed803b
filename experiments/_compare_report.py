"""What experiments/compare.py shows a person: per-link tables, one verdict line per link,
`report.md`, `results.json` and the two figures, all read from the method records that
`compare.run` makes (nothing is computed here that the records do not hold)."""

from __future__ import annotations

import json
import os

import numpy as np

from experiments import _reproduce as rep

HEADERS = ("method", "bytes/step", "DP bytes / bytes", "steps in budget", "loss at budget",
           "time to target", "speed-up", "ended")


def _seconds(s: float | None) -> str:
  if s is None:
    return "-"
  if s >= 1:
    return f"{s:,.1f} s"
  return f"{s * 1e3:,.1f} ms" if s >= 1e-3 or s == 0 else f"{s * 1e6:,.1f} us"


def _link_text(link) -> str:
  gbit = link.bandwidth * 8 / 1e9
  rate = f"{gbit:g} Gbit/s" if gbit >= 1 else f"{gbit * 1e3:g} Mbit/s"
  return f"{rate}, {_seconds(link.latency)} per message"


def rows(results: list, link: str) -> list:
  """One row per method on `link`: HEADERS' cells, as text."""
  out = []
  for r in results:
    a = r["links"][link]
    ratio = f"{r['compression_ratio']:.2f}x" if r["compression_ratio"] else "inf"
    ended = (f"reached at step {a['steps_to_target']}" if a["stopped"] == "reached"
             else a["stopped"])
    out.append([r["method"], f"{r['wire_bytes_per_step']:,.0f}", ratio, str(a["steps"]),
                "-" if a["final_loss"] is None else f"{a['final_loss']:.4f}",
                _seconds(a["time_to_target"]) if a["time_to_target"] is not None
                else "not reached",
                f"{a['speedup']:.2f}x" if a["speedup"] else "-", ended])
  return out


def aligned(headers, table_rows) -> str:
  """A fixed-width text table: the first column left-aligned, the others right-aligned."""
  widths = [max(len(str(x)) for x in col) for col in zip(headers, *table_rows)]
  def line(cells):
    return "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w)
                     for i, (x, w) in enumerate(zip(cells, widths)))
  return "\n".join([line(headers), "-" * len(line(headers))] + [line(r) for r in table_rows])


def verdict(results: list, link: str, reference: str, target: float, max_steps: int) -> str:
  """One line: which method reaches the target first on `link` and by what factor over the
  reference, or that the reference is fastest there; step-capped methods are named."""
  timed = sorted((r["links"][link]["time_to_target"], r["method"]) for r in results
                 if r["links"][link]["time_to_target"] is not None)
  ref = next(r for r in results if r["method"] == reference)["links"][link]
  capped = [r["method"] for r in results if r["links"][link]["stopped"] == "step cap"]
  note = (f" Stopped by the step cap ({max_steps}) with budget left: {', '.join(capped)} "
          "(raise --max_steps to let them use it)." if capped else "")
  if not timed:
    return f"{link}: no method reaches loss {target:.4f} within the budget.{note}"
  best_time, best = timed[0]
  if best == reference or best_time == ref["time_to_target"]:
    others = [(t, m) for t, m in timed if m != reference]
    runner = (f"; next: {others[0][1]} in {_seconds(others[0][0])} "
              f"({ref['time_to_target'] / others[0][0]:.2f}x)" if others else "")
    return (f"{link}: {reference} is fastest to loss {target:.4f}, in "
            f"{_seconds(ref['time_to_target'])}{runner}.{note}")
  if ref["time_to_target"] is None:
    return (f"{link}: {best} reaches loss {target:.4f} first, in {_seconds(best_time)}; "
            f"{reference} does not reach it within the budget.{note}")
  return (f"{link}: {best} reaches loss {target:.4f} first, in {_seconds(best_time)}: "
          f"{ref['time_to_target'] / best_time:.2f}x sooner than {reference} "
          f"({_seconds(ref['time_to_target'])}).{note}")


def _heading(config, results: list, target: float, target_source: str) -> str:
  c = config.compare
  m = config.model
  return (f"{len(results)} methods on {results[0]['workers']} workers; LM d_model={m.d_model} "
          f"layers={m.num_layers} on {config.data.name} (batch {config.data.batch_size} x "
          f"{config.data.seq_len}). Target loss {target:.4f} ({target_source}). Budget on "
          f"each link: {c.reference}'s {config.steps} steps there x {c.budget:g}; at most "
          f"{c.max_steps} steps per method.")


def _link_heading(name: str, link, budget: float) -> str:
  return f"{name} ({_link_text(link)}): budget {_seconds(budget)}"


def text(config, links: dict, budgets: dict, target: float, target_source: str,
         results: list) -> tuple[str, list]:
  """The terminal text (heading, a table per link, the verdicts) and the verdict lines."""
  c = config.compare
  parts = [_heading(config, results, target, target_source)]
  for name, link in links.items():
    parts.append(f"\n{_link_heading(name, link, budgets[name])}\n"
                 + aligned(HEADERS, rows(results, name)))
  verdicts = [verdict(results, n, c.reference, target, c.max_steps) for n in links]
  parts.append("\nVerdict (time to the target loss on each link):\n"
               + "\n".join(f"  {v}" for v in verdicts))
  return "\n".join(parts), verdicts


def markdown(config, links: dict, budgets: dict, target: float, target_source: str,
             results: list, verdicts: list, plots: list, command: str | None = None) -> str:
  """report.md: heading, verdicts, a table per link, the links' sources, figures, settings."""
  sections = ["# Which method reaches the target loss first, on each link",
              _heading(config, results, target, target_source),
              "Time is simulated: one worker's compute per step measured on this machine "
              "plus the communication of each method's compiled step on the link, less what "
              "its schedule overlaps (experiments/compare.py). \"ended\": reached the target "
              "(at that step), spent the budget without reaching it, or was stopped by the "
              "step cap with budget left.",
              "## Verdict\n\n" + "\n".join(f"* {v}" for v in verdicts)]
  for name, link in links.items():
    sections.append(f"## {_link_heading(name, link, budgets[name])}\n\n"
                    + rep.markdown_table(HEADERS, rows(results, name)))
  sections.append("## Links\n\n" + rep.markdown_table(
      ["link", "bandwidth, latency", "source"],
      [[n, _link_text(l), l.source or "-"] for n, l in links.items()]))
  sections.append("## Figures\n\n" + "\n\n".join(
      f"![{os.path.splitext(os.path.basename(p))[0]}]({os.path.basename(p)})" for p in plots))
  settings = [[r["method"], r["algo"], _settings_text(r["settings"]),
               _settings_text(r["optimizer"]), str(r["overlap_steps"]),
               _seconds(r["compute_seconds_per_step"])] for r in results]
  sections.append("## Settings\n\n" + rep.markdown_table(
      ["method", "module", "settings", "optimizer", "overlap steps", "compute/step"],
      settings) + "\n\nShared: " + _settings_text(
          {"steps": config.steps, "seed": config.seed, "mesh": config.mesh or "data=all",
           "model": config.model.to_dict(), "data": config.data.to_dict(),
           "compare": config.compare.to_dict()})
                  + (f"\n\nCommand: `{command}`" if command else ""))
  return "\n\n".join(sections) + "\n"


def _settings_text(settings: dict) -> str:
  return ", ".join(f"{k}={v}" for k, v in settings.items() if k != "name" and v is not None)


# ---------------------------------------------------------------- figures
_STYLES = {"dp": "-", "compressed": "--", "powersgd": "--", "demo": "--",
           "diloco": "-.", "streaming_diloco": "-.", "acco": ":", "delayed": ":"}


def _style(i: int, record: dict, reference: str) -> dict:
  import matplotlib  # pylint: disable=import-outside-toplevel
  colors = matplotlib.colormaps["tab10"].colors + matplotlib.colormaps["Dark2"].colors
  return {"color": colors[i % len(colors)], "linestyle": _STYLES.get(record["algo"], "-"),
          "linewidth": 2.0 if record["method"] == reference else 1.4,
          "label": record["method"]}


def _legend(fig, ax, target: float) -> None:
  """Target line, and one legend beside the plot for every curve."""
  ax.axhline(target, color="black", linestyle=(0, (1, 3)), linewidth=1,
             label=f"target loss {target:.3f}")
  handles, labels = ax.get_legend_handles_labels()
  fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)


def plot(results: list, config, links: dict, budgets: dict, target: float,
         workdir: str) -> list:
  """loss_vs_time.png (a panel per link: each method's smoothed loss against the clock of
  the steps that link's budget allows, target and budget marked) and loss_vs_bytes.png."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  reference, smooth = config.compare.reference, config.compare.smooth
  ylabel = f"training loss (mean of last {smooth} steps)"
  paths = []
  fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links) + 1.8, 4.5),
                           squeeze=False)
  for ax, name in zip(axes[0], links):
    for i, r in enumerate(results):
      n = r["links"][name]["steps"]
      ax.plot(r["links"][name]["time"][:n], r["curve"]["smoothed_loss"][:n],
              **_style(i, r, reference))
    ax.axvline(budgets[name], color="gray", linestyle="--", linewidth=1)
    ax.text(budgets[name], 0.98, " budget", transform=ax.get_xaxis_transform(), va="top",
            ha="right", fontsize=8, color="gray")
    ax.set_xlim(0, budgets[name] * 1.03)
    ax.set_xlabel(f"simulated wall clock on '{name}' (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"loss vs time: {name}")
    ax.grid(True, alpha=0.3)
  _legend(fig, axes[0][0], target)
  for ax in axes[0][1:]:
    ax.axhline(target, color="black", linestyle=(0, (1, 3)), linewidth=1)
  fig.tight_layout(rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1))
  paths.append(os.path.join(workdir, "loss_vs_time.png"))
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(8.8, 4.5))
  for i, r in enumerate(results):
    # A local-update method sends nothing before its first sync: a log axis starts there.
    sent = np.asarray(r["curve"]["cumulative_wire_bytes"], dtype=np.float64)
    keep = sent > 0
    ax.plot(sent[keep], np.asarray(r["curve"]["smoothed_loss"])[keep],
            **_style(i, r, reference))
  ax.set_xscale("log")
  ax.set_xlabel("cumulative wire bytes sent per device (log scale)")
  ax.set_ylabel(ylabel)
  ax.set_title("loss vs communication (each method's whole run)")
  ax.grid(True, alpha=0.3)
  _legend(fig, ax, target)
  fig.tight_layout(rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1))
  paths.append(os.path.join(workdir, "loss_vs_bytes.png"))
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def write(config, workdir: str, links: dict, budgets: dict, target: float,
          target_source: str, results: list, command: str | None = None) -> dict:
  """Writes the figures, report.md and results.json into `workdir`; returns the summary
  (what results.json holds, with the terminal text under "text")."""
  os.makedirs(workdir, exist_ok=True)
  printed, verdicts = text(config, links, budgets, target, target_source, results)
  plots = plot(results, config, links, budgets, target, workdir)
  report = os.path.join(workdir, "report.md")
  with open(report, "w", encoding="utf-8") as f:
    f.write(markdown(config, links, budgets, target, target_source, results, verdicts, plots,
                     command))
  summary = {
      "config": config.to_dict(), "reference": config.compare.reference,
      "target_loss": target, "target_source": target_source,
      "links": {n: {"bandwidth": l.bandwidth, "latency": l.latency, "source": l.source,
                    "budget_seconds": budgets[n]} for n, l in links.items()},
      "methods": results, "text": printed, "verdicts": verdicts, "plots": plots,
      "report": report, "command": command}
  with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  return summary
