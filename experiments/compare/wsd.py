"""Warmup-stable-decay in experiments.compare (`config.compare.schedule="wsd"`): the
warmup and stable phase trains once per method, setting and seed (the comparison's own
trials), and per link a short decay branches from the state at that link's branch point.

Rankings of training methods can flip before a learning-rate decay ends (Wen et al., arXiv
2509.02046), and a decay has to end where the budget ends, which differs per link. So per
link the branch point is the first step whose clock reaches `1 - decay_fraction` of the
link's budget (the population's states there are kept: `Population.watch`); from it the
inner optimiser's rate falls linearly (`build.wsd_schedule`, counted in the inner
optimiser's own updates) over the steps that fit in the rest of the budget, and the
held-out loss at the end is the method's loss at the budget with a decay. The report sets
it beside the held-out loss after the same steps from the same state at the stable rate,
per link, median over seeds: does the decay change which method is best?

A population that passed a branch point before the budgets were known (the reference pool,
which sets them) is trained again from its seeds to that point (the same trajectory); one
that stopped before it (it reached the target early) trains on to it. Where the step cap
(`max_steps`) ends a run before the link's budget, the last `decay_fraction` of the capped
run decays instead (branch step floor((1 - f) cap)): the loss at the end of what it may
train.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import build
from . import stats
from . import trials as trials_


def watch(budgets: dict, fraction: float, cap: int) -> dict:
  """The branch points: {"links": {link: seconds} (`Population.watch`), "step": the one of
  a run the step cap ends before its budget (`Population.watch_step`)}."""
  return {"links": {n: (1.0 - fraction) * b for n, b in budgets.items()},
          "step": max(1, math.floor((1.0 - fraction) * cap))}


def _updates(opt_state) -> int | None:
  """The inner optimiser's update count in a state (the largest over trials and workers),
  or None for a method without a scheduled inner optimiser (DeMo)."""
  kind = optax.ScaleByScheduleState
  counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kind))
            if isinstance(s, kind)]
  return int(np.max(np.asarray(counts[0]))) if counts else None


def _snapshot(pop, link: str, links_: dict, cap: int, chunk: int):
  """(step, states) at `link`'s branch point: kept, trained on to, or trained again."""
  while link not in pop.snapshots and pop.trained < cap:
    if pop.trials[0].clocks(pop.grid[0])[link].known[-1] >= pop.watch[link]:
      # Passed before it was watched: the same seeds trained again, to the branch point.
      again = trials_.Population(pop.label, pop.setting, pop.configs, links_, pop.heldout,
                                 pop.together)
      again.evaluate_on(*pop.grid)
      again.watch, again.watch_step = dict(pop.watch), pop.watch_step
      while link not in again.snapshots and again.trained < pop.trained:
        again.train_to(min(again.trained + chunk, pop.trained))
      pop.snapshots.update({n: v for n, v in again.snapshots.items()
                            if n not in pop.snapshots})
      break
    pop.train_to(min(pop.trained + chunk, cap))
  return pop.snapshots.get(link)


def _run(pop, trainers: list, states: list, step: int, steps: int) -> list:
  """Held-out losses of `pop`'s trials after `steps` steps of `trainers` from `states`."""
  out = []
  for k, (trainer, state) in enumerate(zip(trainers, states)):
    state = jax.tree.map(jnp.copy, state)  # the step donates its state's buffers
    for t in range(step, step + steps):
      state, _ = trainer.step(state, pop._batch(k, t))
    out.extend(pop.evaluate(trainer, state))
  return out


def decay(pop, step: int, states: list, steps: int) -> tuple[list, list, bool]:
  """(held-out loss per trial after `steps` decay steps from `states` at `step`, the same
  after `steps` steps at the stable rate, decayed?): the inner optimiser's rate falls
  linearly from its update count there; a method without one does not decay."""
  stable = _run(pop, pop.trainers, states, step, steps)
  count = _updates(states[0].opt_state)
  if count is None:
    return stable, stable, False
  configs = []
  for c in pop.configs:
    c = c.copy_and_resolve_references()
    with c.unlocked():
      c.optimizer.decay_start = count
      c.optimizer.decay_steps = max(1, round(steps * count / step))
    configs.append(c)
  runs = [build.build(c) for c in configs]
  branch = trials_.trainers(runs, pop.together)
  if pop.together:  # init builds a trainer's layout (the state returned is not used)
    branch[0].init(jax.tree.map(lambda *x: jnp.stack(x), *[r.params for r in runs]))
  else:
    for trainer, r in zip(branch, runs):
      trainer.init(r.params)
  return _run(pop, branch, states, step, steps), stable, True


def branches(pops: dict, budgets: dict, cap: int, chunk: int, links_: dict) -> dict:
  """{label: [per setting {link: {"branch_step", "decay_steps", "decayed", "heldout"
  (per seed)} or None (the step cap came first)}]}: per population (its `watch` set) and
  link, the decay from the branch point over the steps that fit in the rest of the budget
  (at the mean step time so far)."""
  out = {}
  for label, ps in pops.items():
    out[label] = []
    for pop in ps:
      per_link = {}
      for n in budgets:
        snap = _snapshot(pop, n, links_, cap, chunk)
        if snap is None:  # the step cap ends the run first: its last fraction decays
          snap = pop.snapshots.get(trials_.CAPPED)
          if snap is None:
            per_link[n] = None
            continue
        step, states = snap
        known = pop.trials[0].clocks(pop.grid[0])[n].known
        per = known[step - 1] / step
        steps = max(1, min(cap - step, math.floor((budgets[n] - known[step - 1]) / per)))
        losses, stable, decayed = decay(pop, step, states, steps)
        per_link[n] = {"branch_step": step, "decay_steps": steps, "decayed": decayed,
                       "heldout": losses, "stable": stable}
      out[label].append(per_link)
  return out


def summary(found: dict, links: list) -> dict:
  """{label: {link: {"stable", "decayed"}}}: per link the median over seeds of the held-out
  loss at the budget, at the stable rate and after the decay, both run from the branch
  point over the same steps (per seed the lowest over settings; a setting the step cap
  stopped before its branch point counts as infinite)."""
  out = {}
  for label, per_setting in found.items():
    out[label] = {}
    for n in links:
      seeds = max(len(b[n]["heldout"]) for b in per_setting if b[n]) if any(
          b[n] for b in per_setting) else 1
      out[label][n] = {key: stats.median_time(stats.best_per_study(
          [b[n][field] if b[n] else [None] * seeds for b in per_setting])[0])
          for key, field in (("stable", "stable"), ("decayed", "heldout"))}
  return out


def best(table: dict, link: str, key: str) -> str:
  """The method with the lowest median held-out loss at the budget on `link`."""
  return min(table, key=lambda m: table[m][link][key])


def lines(table: dict, links: list, first: dict) -> list:
  """Per link: the lowest held-out loss at the budget with and without the decay, and
  the method first to the target at the stable rate (`first[link]`)."""
  out = []
  for n in links:
    a, b = best(table, n, "stable"), best(table, n, "decayed")
    out.append(f"{n}: lowest held-out at the budget: stable rate {a} "
               f"({table[a][n]['stable']:.4f}), after the decay {b} "
               f"({table[b][n]['decayed']:.4f}); first to the target at the stable rate: "
               f"{first[n]}" + ("." if a == b == first[n] else " (they differ)."))
  return out


def markdown(decays: dict, links: list, first: dict, fraction: float, table_fn) -> str:
  """report.md's warmup-stable-decay section; `table_fn(headers, rows)` a markdown table."""
  table, found = decays["summary"], decays["branches"]
  rows = []
  for m, per_link in table.items():
    for n in links:
      b = found[m][0][n]
      rows.append([m, n, f"{per_link[n]['stable']:.4f}", f"{per_link[n]['decayed']:.4f}",
                   str(b["branch_step"]) if b else "-", str(b["decay_steps"]) if b else "-",
                   "yes" if b and b["decayed"] else "no"])
  return ("## Warmup-stable-decay\n\nThe trials above are the warmup and stable phase. Per "
          f"link a decay branches from the state at the first step past {1 - fraction:g} of "
          "the budget and runs, the inner rate falling linearly, over the steps that fit in "
          "the rest of it; the same steps from the same state at the stable rate beside it. "
          "Held-out loss at the budget, median over seeds (branch and decay steps of the "
          "first setting):\n\n"
          + "\n".join(f"* {x}" for x in lines(table, links, first)) + "\n\n"
          + table_fn(["method", "link", "stable rate", "after the decay", "branch step",
                      "decay steps", "decayed"], rows))
