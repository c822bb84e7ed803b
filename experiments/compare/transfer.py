"""The transfer check (config.compare.proxies = 2): the comparison run again with a proxy of at
least 4x the parameters, and per method its steps to the target relative to the reference's
(bf16 DP, whose trials set each size's own target) at each size; a method whose rank changes
between the sizes gets a line (rankings flip with scale: Wen et al., arXiv 2509.02046)."""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np

from . import account as acc
from . import scale

RATIO = 4  # the larger proxy has at least this many times the parameters


def parameters(config) -> int:
  """The proxy's parameter count (shapes only: nothing is initialised)."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(scale.abstract_params(config))))


def larger(config):
  """`config` with a proxy of at least RATIO x the parameters: d_model and d_ff doubled, and
  blocks added until the count is reached."""
  c = config.copy_and_resolve_references()
  base = parameters(config)
  with c.unlocked():
    c.model.d_model *= 2
    c.model.d_ff *= 2
  while parameters(c) < RATIO * base:
    with c.unlocked():
      c.model.num_layers += 1
  return c


def steps_to_target(out: dict) -> dict:
  """{method: median over seeds of its steps to the target}: each trial's (its first setting)
  held-out readings, interpolated around the target (`account.steps_to`), with no budget
  (the loss side only); a trial that never got there counts as infinity."""
  target, found = out["target_loss"], {}
  for r in out["methods"]:
    per_seed = [acc.steps_to(t["evals"]["step"], t["evals"]["heldout_loss"], target)
                for t in r["trials"] if t["setting"] == 0]
    per_seed = [math.inf if s is None else s for s in per_seed]
    found[r["method"]] = float(np.median(per_seed)) if per_seed else math.inf
  return found


def relative(out: dict, reference: str) -> dict:
  """{method: steps to the target / the reference's}."""
  steps = steps_to_target(out)
  ref = steps[reference]
  return {m: (s / ref if math.isfinite(s) and math.isfinite(ref) else math.inf)
          for m, s in steps.items()}


def ranks(ratios: dict) -> dict:
  """{method: rank by steps to the target relative to the reference, 1 = fewest}."""
  order = sorted(ratios, key=lambda m: ratios[m])
  return {m: i + 1 for i, m in enumerate(order)}


def summary(small: dict, big: dict, reference: str, sizes: tuple) -> dict:
  """Per method the relative steps and rank at both sizes, and the lines for rank changes."""
  a, b = relative(small, reference), relative(big, reference)
  common = [m for m in a if m in b]
  ra, rb = ranks({m: a[m] for m in common}), ranks({m: b[m] for m in common})
  lines = [f"{m}: rank {ra[m]} at {sizes[0]:,} parameters ({_x(a[m])} {reference}'s steps), "
           f"rank {rb[m]} at {sizes[1]:,} ({_x(b[m])})" for m in common if ra[m] != rb[m]]
  return {"reference": reference, "parameters": list(sizes),
          "methods": {m: {"small": a[m], "large": b[m], "rank_small": ra[m],
                          "rank_large": rb[m]} for m in common},
          "rank_changes": lines}


def _x(v: float) -> str:
  return "never" if math.isinf(v) else f"{v:.2f}x"


def markdown(t: dict) -> str:
  """report.md's section."""
  small, large = t["parameters"]
  rows = "\n".join(f"| {m} | {_x(v['small'])} | {v['rank_small']} | {_x(v['large'])} | "
                   f"{v['rank_large']} |" for m, v in t["methods"].items())
  changes = "\n".join(f"* {line}" for line in t["rank_changes"]) or \
      "* No method's rank changed between the two sizes."
  return (f"## Transfer across proxy sizes\n\nSteps to the target relative to "
          f"{t['reference']}'s (median over seeds), at the proxy's {small:,} parameters and "
          f"at {large:,} ({large / small:.1f}x; its own target, from its own "
          f"{t['reference']}):\n\n| method | steps / {t['reference']}'s | rank | at "
          f"{large / small:.1f}x | rank |\n|---|---|---|---|---|\n{rows}\n\n{changes}\n")


def check(config, workdir: str, out: dict, verbose: bool, run) -> None:
  """The transfer check after the comparison `out` (run(config, workdir) runs one): again
  with the larger proxy into workdir/proxy_large, then the section in report.md."""
  big = larger(config)
  sizes = (parameters(config), parameters(big))
  if verbose:
    print(f"the transfer check: the proxy at {sizes[1]:,} parameters "
          f"({sizes[1] / sizes[0]:.1f}x)...", flush=True)
  out_big = run(big, os.path.join(workdir, "proxy_large"))
  reference = config.compare.reference  # its trials set each size's target: they reach it
  found = summary(out, out_big, reference, sizes)
  append(workdir, found, out)
  if verbose:
    print(f"\nTransfer across proxy sizes (steps to the target relative to {reference}'s):\n"
          + "\n".join(f"  {line}" for line in found["rank_changes"] or ["no rank changed"]))


def append(workdir: str, t: dict, out: dict) -> None:
  """Adds the section to workdir's report.md and the numbers to results.json."""
  with open(os.path.join(workdir, "report.md"), "a", encoding="utf-8") as f:
    f.write("\n" + markdown(t))
  out["transfer"] = t
  path = os.path.join(workdir, "results.json")
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  saved["transfer"] = t
  with open(path, "w", encoding="utf-8") as f:
    json.dump(saved, f, indent=1)
