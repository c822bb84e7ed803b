"""The trials of experiments.compare: one method at one setting and one seed each, trained
together as a population (one compiled program over a leading trial axis, or the seeds one
after the other), their held-out loss evaluated untimed on each link's grid of simulated
time (`experiments/compare/account.py`), and each trial's clock on every link."""

from __future__ import annotations

import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import build
from . import account as acc
from . import clock as _clock
from . import schedule as _schedule
from jaxcomm import comm, data, train

CAPPED = "step cap"  # the snapshot key of a run's branch point when the step cap ends it


class Population:
  """The trials of one method at one setting, one per seed (`configs[s]`), built and
  compiled once and trained together in chunks, their held-out loss evaluated (untimed)
  every `eval_every` steps until `evaluate_on` gives each link's interval of simulated
  time, then at the first step past each multiple of it on any link where a trial has not
  yet reached the target (`aim`, once the target is known). With `together`, one
  program: `Trainer(trials=S)` (a leading trial axis on parameters, state and batch, the
  local step vmapped; each trial's codec keys folded with its seed); otherwise the seeds
  one after the other, each its own run (the fallback for a method whose step cannot be
  vmapped, and for one seed)."""

  def __init__(self, label: str, setting: int, configs: list, links_: dict, heldout,
               together: bool):
    self.label, self.setting, self.configs, self.heldout = label, setting, configs, heldout
    self.runs = [build.build(c) for c in configs]
    r = self.runs[0]
    self.trainers = trainers(self.runs, together)
    if together:
      params = jax.tree.map(lambda *x: jnp.stack(x), *[run.params for run in self.runs])
      state = self.trainers[0].init(params)
      seeds = jnp.array([c.seed for c in configs])
      self.states = [state._replace(opt_state=train.fold_in_trials(state.opt_state, seeds))]
    else:
      self.states = [t.init(run.params) for t, run in zip(self.trainers, self.runs)]
    if together:
      # One trial's program, for its collectives: under vmap a schedule's "sync this step?"
      # on a per-trial counter becomes a select, so the population's program runs every
      # branch's collectives on every step (its counted bytes stay exact per trial).
      one = train.Trainer(r.loss_fn, r.optimizer, r.mesh, batch_axes=r.batch_axes,
                          param_specs=r.specs, has_aux=r.has_aux, batch_specs=r.batch_specs,
                          mutable=r.config.model.mutable)
      state, batch = one.init(r.params), one.shard_batch(r.batches(0))
      report = inspect_only(one.step_fn(state, batch), state, batch, r.mesh)
    else:
      batch = self._batch(0, 0)
      report = comm.inspect(self.trainers[0].step_fn(self.states[0], batch), self.states[0],
                            batch)
    if (r.config.compare.get("schedule", "constant") == "schedule_free"
        and _schedule.eval_params(self.states[0].params, self.states[0].opt_state) is
        self.states[0].params):
      print(f"  {label}: no inner optimiser (config.optimizer) to make schedule-free; it "
            "runs as its method module builds it.", file=sys.stderr, flush=True)
    self.together = together
    self.report = report
    self.costs = {name: comm.cost(report, link) for name, link in links_.items()}
    hooks = build.hooks(r.method)
    self.overlap = int(hooks.overlap_steps(r.config.method))
    self.overlap_backward = bool(hooks.overlap_backward(r.config.method))
    self.trials = [Trial(self, s) for s in range(len(configs))]
    self.seconds, self.grid = 0.0, None
    self.target = None  # once known (`aim`): evaluations that cannot change a time are skipped
    # wsd.py's branch points: link -> seconds, and a step (for a run the cap ends);
    # what is kept there: link (or CAPPED) -> (step, states)
    self.watch, self.watch_step, self.snapshots = {}, 0, {}

  @property
  def trained(self) -> int:
    return len(self.trials[0].history)

  def _batch(self, k: int, step: int):
    """Global batch `step` of trainer k (all trials stacked when together)."""
    if len(self.trainers) == 1 and len(self.runs) > 1:
      local = {key: np.stack([run.batches(step)[key] for run in self.runs])
               for key in self.runs[0].batches(step)}
    else:
      local = self.runs[k].batches(step)
    return self.trainers[k].shard_batch(local)

  def evaluate(self, trainer, state, which: list | None = None) -> list:
    """Held-out losses of a trainer's trials (those at the indices `which`, default all):
    the parameters (a schedule-free optimiser's evaluation parameters) averaged over
    workers."""
    lead = 1 if trainer.trials else 0
    params = jax.tree.map(lambda x: np.asarray(x),
                          _schedule.eval_params(state.params, state.opt_state))
    which = range(trainer.trials if lead else 1) if which is None else which
    views = [jax.tree.map(lambda x, t=t: x[t], params) for t in which] if lead else [params]
    return [float(self.heldout(jax.tree.map(lambda pw, x: x.mean(0) if pw else x,
                                            trainer.layout.params, v))) for v in views]

  def train_to(self, steps: int) -> None:
    start = time.perf_counter()
    for step in range(self.trained, steps):
      for k, trainer in enumerate(self.trainers):
        self.states[k], m = trainer.step(self.states[k], self._batch(k, step))
        loss, sent = np.atleast_1d(m["loss"]), np.atleast_1d(m["wire_bytes"])
        owned = self.trials if trainer.trials else [self.trials[k]]
        for t, trial in enumerate(owned):
          trial.history.append({"step": step + 1, "loss": float(loss[t]),
                                "wire_bytes": float(sent[t])})
        due = self._due(owned, step + 1)
        if due:
          values = self.evaluate(trainer, self.states[k], [owned.index(t) for t, _ in due])
          for (trial, links), value in zip(due, values):
            trial.evals.append((step + 1, value))
            if self.target is not None and value <= self.target:
              trial.hit.update(links)
      self._snapshot(step + 1)
    self.seconds += time.perf_counter() - start

  def evaluate_on(self, clock, intervals: dict) -> None:
    """From the next step on, evaluate on each link's grid: at the first step whose clock
    (`clock`, as `Trial.clocks` reads it) reaches each multiple of `intervals[link]`
    seconds. The multiples reached by the last evaluation so far count as evaluated."""
    self.grid = (clock, dict(intervals))
    for trial in self.trials:
      last = trial.evals[-1][0] if trial.evals else 0
      trial.reached = {n: acc.multiples(tl.known[last - 1], intervals[n]) if last else 0
                       for n, tl in trial.clocks(clock).items()}

  def aim(self, target: float) -> None:
    """From now on, skip the evaluations that cannot change a time to `target`: a trial is
    evaluated at a step of a link's grid only while it has not yet reached the target on
    that link (a time to the target is read at the first evaluation on the link's grid at
    or below it, `account.account`, on the measured clock and on the scaled ones;
    later ones there change no number of the verdict, only the plotted curve's tail)."""
    self.target = target
    for trial in self.trials:
      trial.hit = {n for n in self.costs
                   if self.grid and np.any(trial.evals_on(n)[1] <= target)}

  def _due(self, trials: list, step: int) -> list:
    """(trial, links) of those of `trials` evaluated at `step` (just trained): all of them
    on the step rule (no links); on the grids, those for which it reaches a new multiple of
    the interval of a link where they have not yet reached the target (`aim`; every trial's
    count moves on), with the links whose multiple it reaches."""
    if self.grid is None:
      on_rule = step % self.configs[0].compare.eval_every == 0
      return [(t, []) for t in trials] if on_rule else []
    clock, intervals = self.grid
    due = []
    for trial in trials:
      links = []
      for n, tl in trial.clocks(clock).items():
        m = acc.multiples(tl.known[-1], intervals[n])
        if m > trial.reached[n]:
          trial.reached[n] = m
          links.append(n)
      if any(n not in trial.hit for n in links):
        due.append((trial, links))
    return due

  def _snapshot(self, step: int) -> None:
    """Keeps a copy of the states (the step donates their buffers) at the first step whose
    clock (the first trial's) reaches a watched link's seconds (`wsd.py`'s branch
    points)."""
    if step == self.watch_step and CAPPED not in self.snapshots:
      self.snapshots[CAPPED] = (step, [jax.tree.map(jnp.copy, x) for x in self.states])
    todo = [n for n in self.watch if n not in self.snapshots]
    if todo:
      timelines = self.trials[0].clocks(self.grid[0])
      for n in todo:
        if timelines[n].known[-1] >= self.watch[n]:
          self.snapshots[n] = (step, [jax.tree.map(jnp.copy, x) for x in self.states])

  def train_until_reached(self, clock, target: float, cap: int, chunk: int) -> None:
    """Trains until every trial has reached the target on every link (no budget), or to
    `cap` steps: a trial of the reference pool, whose times set the budgets."""
    free = {n: math.inf for n in self.costs}
    while self.trained < cap and any(
        a["stopped"] != acc.REACHED for t in self.trials
        for a in t.accounts(clock, free, target, cap).values()):
      self.train_to(min(self.trained + chunk, cap))

  def train_within(self, clock, budgets: dict, target: float, cap: int, chunk: int) -> None:
    """Trains until every trial has reached the target or spent its budget on every link,
    or to `cap` steps."""
    while self.trained < cap:
      goals = [g for g in (t.goal(clock, budgets, target, cap) for t in self.trials) if g]
      if not goals:
        return
      self.train_to(min(max(goals), self.trained + chunk, cap))


class Trial:
  """One method at one setting and one seed: its curve, held-out evaluations and clocks
  (its population trains it)."""

  def __init__(self, population: Population, seed: int):
    self.population, self.seed = population, seed
    self.history, self.evals = [], []
    self.reached = {}  # link -> multiples of its interval evaluated (evaluate_on)
    self.hit = set()  # links where it has reached the target (`aim`)
    self._clocks = {}  # id(clock) -> (clock, steps trained, clocks): read many times a step

  def __getattr__(self, name):  # label, setting, report, costs, overlap, overlap_backward
    return getattr(self.__dict__["population"], name)

  @property
  def config(self):
    return self.population.configs[self.seed]

  @property
  def trainer(self):
    return self.population.trainers[0]

  @property
  def step_bytes(self) -> np.ndarray:
    return np.array([row["wire_bytes"] for row in self.history], dtype=np.float64)

  def clocks(self, clock) -> dict:
    """{link: Timeline} of the steps trained; `clock(trial, link)` gives (compute, exposed)."""
    cached = self._clocks.get(id(clock))
    if cached and cached[0] is clock and cached[1] == len(self.history):
      return cached[2]
    out = {}
    for name, cost in self.costs.items():
      compute, exposed = clock(self, name)
      out[name] = _clock.timeline(compute, self.step_bytes, cost, self.overlap, exposed)
    self._clocks[id(clock)] = (clock, len(self.history), out)
    return out

  def evals_on(self, link: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, held-out losses) of the evaluations that count on `link`: those on its grid
    of the population's measured clock (`Population.evaluate_on`), or all of them."""
    steps, losses = (np.array(v) for v in zip(*self.evals)) if self.evals else (
        np.zeros(0, np.int64), np.zeros(0))
    if self.grid is None:
      return steps, losses
    clock, intervals = self.grid
    keep = acc.on_grid(steps, self.clocks(clock)[link].known, intervals[link])
    return steps[keep], losses[keep]

  def accounts(self, clock, budgets: dict, target: float, cap: int) -> dict:
    """{link: `account`} on `clock` (the measured one, or a scaled one: the same evaluations,
    those on each link's grid of the measured clock)."""
    return {n: acc.account(*self.evals_on(n), t.known, target, budgets[n], cap)
            for n, t in self.clocks(clock).items()}

  def goal(self, clock, budgets: dict, target: float, cap: int) -> int | None:
    """The steps to train to for the links still open (not reached, budget left), or None."""
    timelines = self.clocks(clock)
    done = self.accounts(clock, budgets, target, cap)
    open_links = [n for n, t in timelines.items() if done[n]["stopped"] != acc.REACHED
                  and t.known[-1] <= budgets[n]]
    if not open_links:
      return None
    return max(acc.steps_to_try(timelines[n].known, budgets[n], cap) for n in open_links)


def trainers(runs: list, together: bool) -> list:
  """The trainers of a population's runs (one per seed): one over a leading trial axis
  (`together`), or one per run."""
  size = len(runs) if together else None
  return [train.Trainer(
      r.loss_fn, r.optimizer, r.mesh, batch_axes=r.batch_axes, param_specs=r.specs,
      has_aux=r.has_aux, batch_specs=r.batch_specs, mutable=r.config.model.mutable,
      trials=size) for r in (runs[:1] if together else runs)]


# ---------------------------------------------------------------- trials of a population
def train_population(label: str, setting: int, configs: list, links_: dict, heldout,
                     steps: int, together: bool = True, grid: tuple | None = None,
                     watch: dict | None = None, target: float | None = None) -> Population:
  """The trials of one method at one setting, one per seed, trained to `steps`: as one
  program when `together` and there are several seeds, else one after the other; a method
  whose step cannot be vmapped (a ValueError, TypeError or NotImplementedError while it is
  built or traced) falls back to one after the other, and says so on stderr. `grid`:
  (clock, intervals) of `Population.evaluate_on`, from the first step; `watch`: its
  {"links": `Population.watch`, "step": `Population.watch_step`} (the branch points of
  `wsd.py`); `target`: `Population.aim`'s."""
  together = together and len(configs) > 1

  def trained(as_one: bool) -> Population:
    pop = Population(label, setting, configs, links_, heldout, as_one)
    if grid:
      pop.evaluate_on(*grid)
    if watch:
      pop.watch, pop.watch_step = dict(watch["links"]), watch["step"]
    if target is not None:
      pop.aim(target)
    pop.train_to(steps)
    return pop

  try:
    return trained(together)
  except (ValueError, TypeError, NotImplementedError) as e:
    if not together:
      raise
    print(f"  {label}: no population in one program ({type(e).__name__}: "
          f"{str(e).splitlines()[0][:200]}); its seeds run one after the other.",
          file=sys.stderr, flush=True)
    return trained(False)


# The one-trial program is compiled only to read its collectives, never run: without LLVM's
# optimisations, in about 60 % of the compile time. XLA's HLO passes, whose output
# `comm.parse_hlo` reads, do not depend on them (the optimised HLO of dp's and diloco_h10's
# steps compared equal with and without).
_INSPECT_ONLY = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def inspect_only(fn, state, batch, mesh) -> comm.CollectiveReport:
  """`comm.inspect(fn, state, batch)` of a program that is never run (`_INSPECT_ONLY`)."""
  text = fn.lower(state, batch).compile(compiler_options=_INSPECT_ONLY).as_text()
  return comm.parse_hlo(text, mesh=mesh)


def heldout_fn(config):
  """`params -> held-out loss` on a fixed batch of the test split (the same for every trial:
  one compiled function)."""
  _, loss_fn, has_aux, _, _ = build.model_task(config)
  test = data.load(config.data.name).split()[1]
  batch = test.batch(0, config.compare.eval_batch, seq_len=config.data.seq_len, seed=12345)
  fn = jax.jit(lambda p: loss_fn(p, batch)[0] if has_aux else loss_fn(p, batch))
  return fn
