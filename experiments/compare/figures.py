"""The figures of experiments.compare: held-out loss against each link's simulated time
and against bytes sent, and the performance profile, read from the method records."""

from __future__ import annotations

import os

import numpy as np

from . import stats


_STYLES = {"dp": "-", "compressed": "--", "powersgd": "--", "demo": "--",
           "diloco": "-.", "streaming_diloco": "-.", "acco": ":", "delayed": ":"}


def _style(i: int, r: dict, reference: str) -> dict:
  import matplotlib  # lazy: heavy, and only plots need it
  colors = matplotlib.colormaps["tab10"].colors + matplotlib.colormaps["Dark2"].colors
  return {"color": colors[i % len(colors)], "linestyle": _STYLES.get(r["algo"], "-"),
          "linewidth": 2.0 if r["method"] == reference else 1.4, "label": r["method"]}


def _shown(r: dict, link: str) -> dict:
  """The trial a figure shows: seed 0 at the setting study 0 chose on `link`."""
  k = r["links"][link]["chosen_setting"][0]
  return next(t for t in r["trials"] if t["setting"] == k and t["seed"] == 0)


def _save(fig, workdir: str, name: str, rect=None) -> str:
  """Lays `fig` out (within `rect`, if given), writes it to workdir/name, closes it; the
  path."""
  import matplotlib.pyplot as plt
  fig.tight_layout(rect=rect)  # None: the whole figure
  path = os.path.join(workdir, name)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot(records: list, config, links: dict, budgets: dict, target: float, score: dict,
         workdir: str) -> list:
  """loss_vs_time.png (a panel per link: held-out loss of seed 0 against the clock, target
  and budget marked), loss_vs_bytes.png and profile.png."""
  import matplotlib  # lazy: heavy, and only plots need it
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  reference = config.compare.reference
  paths = []
  fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links) + 1.8, 4.5),
                           squeeze=False)
  for ax, name in zip(axes[0], links):
    for i, r in enumerate(records):
      t = _shown(r, name)
      at = [s - 1 for s in t["evals"]["step"]]
      ax.plot(np.asarray(t["links"][name]["time"])[at], t["evals"]["heldout_loss"],
              **_style(i, r, reference))
    ax.axvline(budgets[name], color="gray", linestyle="--", linewidth=1)
    ax.axhline(target, color="black", linestyle=(0, (1, 3)), linewidth=1,
               label=f"target {target:.3f}")
    ax.set_xlim(0, budgets[name] * 1.03)
    ax.set(xlabel=f"simulated wall clock on '{name}' (s)", ylabel="held-out loss (seed 0)",
           title=f"held-out loss vs time: {name}")
    ax.grid(True, alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
  paths.append(_save(fig, workdir, "loss_vs_time.png",
                     rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1)))

  fig, ax = plt.subplots(figsize=(8.8, 4.5))
  first = next(iter(links))
  for i, r in enumerate(records):
    t = _shown(r, first)
    sent = np.cumsum(t["curve"]["wire_bytes"])[[s - 1 for s in t["evals"]["step"]]]
    keep = sent > 0  # a local-update method sends nothing before its first sync
    ax.plot(sent[keep], np.asarray(t["evals"]["heldout_loss"])[keep],
            **_style(i, r, reference))
  ax.axhline(target, color="black", linestyle=(0, (1, 3)), linewidth=1)
  ax.set_xscale("log")
  ax.set(xlabel="cumulative wire bytes sent per device (log scale)",
         ylabel="held-out loss (seed 0)", title="held-out loss vs communication")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8, frameon=False, loc="upper right")
  paths.append(_save(fig, workdir, "loss_vs_bytes.png"))

  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  for i, r in enumerate(records):
    s = score[r["method"]]
    ax.step(stats.TAUS, s["profile"], where="post", **{
        **_style(i, r, reference), "label": f"{r['method']} (area {s['area']:.2f})"})
  ax.set(xlabel="tau: time within tau x of the fastest method",
         ylabel=f"fraction of the {len(links)} links", title="performance profile",
         ylim=(-0.02, 1.02))
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8, frameon=False, loc="lower right")
  paths.append(_save(fig, workdir, "profile.png"))
  return paths
