r"""On my link, which method reaches the held-out loss first, and how much sooner than a
strong data-parallel reference? A benchmark protocol after MLCommons AlgoPerf.

  python -m experiments.compare --workdir=runs/compare          # `make run`
  python -m experiments.compare --ruleset=tuned --seeds=3       # each method's best setting
  python -m experiments.compare --links=wan,internet --link=office:gbit=0.5,latency_ms=40
  python -m experiments.compare --methods=dp_bf16,diloco_h10,/path/to/my_method.py
  python -m experiments.compare --config=experiments/configs/compare.py:long  # larger, longer

Every method trains the same byte-level transformer LM on the train split of the embedded
pydoc corpus, on 8 emulated CPU devices. A trial is one method at one setting and one seed
(the seed sets the initial parameters, the batches and the codecs' keys). A trial's losses
do not depend on the network, only its clock does, so each trial trains once and every
link's clock is read off it (`jaxcomm.sim`): one measured compute figure per local step
(`experiments/_compare_clock.py`: methods with the same local step share it) plus the
communication of the method's compiled step on the link (`comm.inspect`, `comm.cost`) that
its schedule cannot hide: a method module's `overlap_steps` (later steps overlap a sync) or
`overlap_backward` (the all-reduce overlaps the backward pass bucket by bucket,
`sim.backward_overlap`).

* Reference: `config.compare.reference`, bf16 data parallelism with its all-reduce
  overlapped with the backward pass (`dp_bf16`); f32 DP (`dp`) is overlapped the same way.
* Target: the held-out loss (the test split, evaluated every `eval_every` steps, untimed) that
  the reference reaches: the median over seeds of its best held-out loss in `config.steps`
  steps at its tuned setting (the higher middle value for an even number of seeds, so that
  most seeds reach it); `--target_loss` overrides it.
* Budget per link: `budget` times the reference's median time to the target there (2 by
  default, not AlgoPerf's 4/3: local-update methods learn less per step, and twice the
  reference's time still times a method half as fast instead of calling it a miss).
  A trial trains until it has reached the target or spent the budget on every link, or
  `max_steps`.
* A method's time on a link is the median over seeds of its time to the target (a miss
  counts as infinity); its speed-up over the reference comes with a 95 % interval over the
  seeds (`experiments/_compare_stats.py`: exact over all paired resamples for S <= 6, else a
  paired bootstrap), and it is called faster only when the interval excludes 1.
* Schedule (`config.compare.schedule`): `constant` (config.optimizer's learning rate), or
  `schedule_free`: every method's inner optimiser made schedule-free (Defazio et al., arXiv
  2405.15682; `warmup_steps` of linear warmup, no decay to place before a link's budget
  ends, so each trial still trains once for every link), its held-out loss read at the
  schedule-free evaluation parameters (`experiments/_compare_schedule.py`). A method
  without an inner optimiser (DeMo) runs as its module builds it, and says so on stderr.
* `--ruleset=default`: each method's settings as `METHODS` has them, S seeds.
  `--ruleset=tuned`: each method module's `tuning()` list (at most 5 settings, the same on
  every link), S studies; per study and link the fastest setting's time, then the median
  over studies.

Written into --workdir: `report.md` (verdicts with intervals and seed counts, a table per
link, per-seed times, the compute figures with their spread, a sensitivity line per link at
compute +-20 %, the performance profile's area and the geometric-mean speed-up),
`results.json` (every number), `loss_vs_time.png`, `loss_vs_bytes.png` and `profile.png`.

Methods: `METHODS` (labels; `MORE_METHODS` only when named), any method of
experiments/methods/ by name, or a method module of your own as a dotted module path or a
`.py` file (`--methods=dp_bf16,/path/my_method.py`; its label is the module's name).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.experimental.compilation_cache import compilation_cache as cc

from experiments import _compare_clock as _clock
from experiments import _compare_report as report
from experiments import _compare_schedule as _schedule
from experiments import _compare_stats as stats
from experiments import build
from experiments import config as _config
from jaxcomm import comm, data, sim, train

# label -> the method and its settings (experiments/methods/<method>.py; every setting not
# named keeps the library factory's default), and optionally "optimizer" overrides.
# Local-update methods sync every H = 10 inner steps; a schedule that overlaps communication
# with compute gets its overlap on the simulated clock from its method module's
# `overlap_steps` / `overlap_backward`.
METHODS: dict[str, dict] = {
    # Exact (f32) data parallelism, its all-reduce overlapped with the backward pass.
    "dp": {"method": "dp"},
    # The reference (config.compare.reference): bf16 data parallelism, overlapped the same way.
    "dp_bf16": {"method": "dp", "dtype": "bfloat16"},
    # PowerSGD rank 4 with error feedback, from the first step (arXiv 1905.13727).
    "powersgd_r4": {"method": "powersgd", "rank": 4},
    # Top-k 1% with error feedback: (index, value) pairs all-gathered.
    "topk1%_ef": {"method": "compressed", "codec": "top_k:fraction=0.01", "memory": "ef"},
    # int8 (per-block scales) with error feedback, through the two-phase all-reduce.
    "int8_ef": {"method": "compressed", "codec": "uniform:bits=8,block=256", "memory": "ef",
                "collective": "two_phase"},
    # DeMo (arXiv 2411.19870) as in the paper: k = 32 of every tile of up to 64 x 64 DCT
    # coefficients; a sign update, so a smaller lr than AdamW's.
    "demo": {"method": "demo", "optimizer": {"lr": 1e-3}},
    # DiLoCo (arXiv 2311.08105): inner AdamW, outer Nesterov SGD lr 0.7 momentum 0.9.
    "diloco_h10": {"method": "diloco", "sync_every": 10},
    # Streaming DiLoCo (arXiv 2501.18512): 2 fragments, fp4 outer gradients, each merged
    # tau = 2 inner steps after it is sent (the sync overlaps those steps).
    "streaming_h10": {"method": "streaming_diloco", "sync_every": 10, "fragments": 2,
                      "overlap": 2},
    # ACCO (arXiv 2406.02613): one micro-batch per round; a round's reduce-scatter and
    # all-gather overlap the next round's gradient.
    "acco": {"method": "acco"},
}

# Labels `--methods` may name that a plain `make run` does not run (the methods of
# arXiv 2502.12996, 2505.22549 and 2506.10911 at H = K_x = 10; Local Adam is DES-LOC with
# every period K_x).
MORE_METHODS: dict[str, dict] = {
    "diloco_h10_eager": {"method": "diloco", "sync_every": 10, "eager": True},
    "des_loc_k10": {"method": "des_loc", "sync_every": 10},
    "local_adam_k10": {"method": "des_loc", "sync_every": 10, "state_every": "mu=10,nu=10"},
    "noloco_h10": {"method": "noloco", "sync_every": 10},
}

# How each method ended on a link (besides reaching the target).
REACHED, BUDGET, CAP = "reached", "budget spent", "step cap"
RULESETS = ("default", "tuned")
MAX_SETTINGS = 5  # the most settings a method's tuning() list may hold

# The flags exist only when this module runs as a program: importing it (tests do)
# registers nothing that could clash with another program's flags.
if __name__ == "__main__":
  _WORKDIR = flags.DEFINE_string("workdir", "runs/compare", "Where the report, results and "
                                 "plots go.")
  _METHODS = flags.DEFINE_list(
      "methods", None, "Methods to compare (default: all of METHODS): METHODS labels, method "
      "names of experiments/methods/, dotted module paths or .py files of your own.")
  _LINKS = flags.DEFINE_list("links", None, "Link presets (jaxcomm.comm.PRESETS) to time on; "
                             "default: config.compare.links.")
  _LINK = flags.DEFINE_multi_string("link", [], "A link of your own, added to the others: "
                                    "name:gbit=G,latency_ms=L (repeatable).")
  _BUDGET = flags.DEFINE_float("budget", None, "Each link's time budget as a multiple of the "
                               "reference's median time to the target there (default: "
                               "config.compare.budget).")
  _RULESET = flags.DEFINE_enum("ruleset", None, list(RULESETS), "default: each method's "
                               "settings, S seeds; tuned: each method module's tuning() list, "
                               "S studies (default: config.compare.ruleset).")
  _SEEDS = flags.DEFINE_integer("seeds", None, "Seeds (studies) S (default: "
                                "config.compare.seeds).")
  _TARGET = flags.DEFINE_float("target_loss", None, "The held-out loss to reach (default: "
                               "the reference's, see the module docstring).")
  _MAX_STEPS = flags.DEFINE_integer("max_steps", None, "The most inner steps any method trains "
                                    "(default: config.compare.max_steps).")
  _CONFIG = _config.define_config_flag(
      os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "compare.py"),
      "What every method shares (model, data, optimizer, the reference's steps) and how "
      "results are read (config.compare); `configs/compare.py:long` for the longer run.")
  _DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices.")


# ---------------------------------------------------------------- settings
def check(config) -> None:
  """The comparison's own settings (config.compare); the rest is experiments.config.check."""
  _config.check(config)
  c = config.compare
  for name in ("smooth", "compute_repeats", "max_steps", "seeds", "eval_every", "eval_batch"):
    _config.int_at_least(config, f"compare.{name}", 1)
  if c.ruleset not in RULESETS:
    raise ValueError(f"config.compare.ruleset must be one of {', '.join(RULESETS)}, got "
                     f"{c.ruleset!r}.")
  if c.max_steps < config.steps:
    raise ValueError(f"config.compare.max_steps ({c.max_steps}) must be >= config.steps "
                     f"({config.steps}): the reference trains config.steps to set the budget.")
  _config.int_at_least(config, "compare.warmup_steps", 0)
  if c.schedule not in _config.SCHEDULES:
    raise ValueError("config.compare.schedule must be one of "
                     f"{', '.join(_config.SCHEDULES)}, got {c.schedule!r}.")
  _config.number_in(config, "compare.budget", 1, math.inf, False, "a finite number >= 1")
  if c.target_loss is not None and not math.isfinite(c.target_loss):
    raise ValueError(f"config.compare.target_loss must be finite, got {c.target_loss}.")
  links(config)


def links(config) -> dict:
  """{name: comm.Link} of config.compare.links (preset names or name:gbit=G,latency_ms=L)."""
  specs = list(config.compare.links)
  if not specs:
    raise ValueError("config.compare.links is empty: name at least one link.")
  out = {}
  for spec in specs:
    link = _config.parse_link(spec, "config.compare.links entry")
    if link.name in out:
      raise ValueError(f"config.compare.links names link {link.name!r} twice.")
    out[link.name] = link
  return out


def with_flags(config, links_=None, custom=(), budget=None, max_steps=None, *,
               ruleset=None, seeds=None, target_loss=None):
  """`config` with the command line's --links, --link, --budget, --max_steps, --ruleset,
  --seeds and --target_loss."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    if links_ is not None or custom:
      c.compare.links = tuple(c.compare.links if links_ is None else links_) + tuple(custom)
    if budget is not None:
      c.compare.budget = float(budget)
    if max_steps is not None:
      c.compare.max_steps = int(max_steps)
    if ruleset is not None:
      c.compare.ruleset = ruleset
    if seeds is not None:
      c.compare.seeds = int(seeds)
    if target_loss is not None:
      c.compare.target_loss = float(target_loss)
  return c


def method_config(config, entry: dict):
  """`config` with a METHODS entry applied (`config.with_method`, which checks it), and
  compare's learning-rate schedule (config.compare.schedule) on its optimizer."""
  c = _config.with_method(config, entry)
  if c.compare.get("schedule", "constant") != "constant":  # build.py wraps the inner one
    with c.unlocked():
      c.optimizer.schedule = c.compare.schedule
      c.optimizer.warmup_steps = c.compare.warmup_steps
  return c


def resolve_methods(labels: list | None, catalog: dict | None = None,
                    reference: str = "dp_bf16") -> dict:
  """{label: entry} to run, the reference first (`config.resolve_methods`; by default over
  METHODS, with MORE_METHODS' labels also accepted by name)."""
  known = {**METHODS, **MORE_METHODS} if catalog is None else catalog
  catalog = METHODS if catalog is None else catalog
  if reference not in catalog:
    raise ValueError(f"config.compare.reference {reference!r} is not a method label; "
                     f"allowed: {', '.join(catalog)}.")
  return _config.resolve_methods(labels, catalog, first=reference, known=known)


def settings_list(label: str, entry: dict, ruleset: str) -> list:
  """The METHODS-style entries a method runs under `ruleset`: its own entry (default), or
  its module's `tuning()` list applied to it (tuned; at most MAX_SETTINGS, the same list on
  every link). A tuning item sets method settings by name and the optimizer's by
  `optimizer.<name>`; a module without `tuning()` runs its own entry only."""
  if ruleset == "default":
    return [dict(entry)]
  fn = getattr(build.load_method(entry["method"]), "tuning", None)
  items = list(fn()) if fn else [{}]
  if not 1 <= len(items) <= MAX_SETTINGS:
    raise ValueError(f"{label}: the method module's tuning() lists {len(items)} settings; "
                     f"allowed: 1 to {MAX_SETTINGS}.")
  out = []
  for item in items:
    e = {**entry, "optimizer": dict(entry.get("optimizer", {}))}
    for key, value in item.items():
      if key.startswith("optimizer."):
        e["optimizer"][key.split(".", 1)[1]] = value
      else:
        e[key] = value
    out.append(e)
  return out


# ---------------------------------------------------------------- the accounting of one trial
def account(eval_steps, eval_losses, known, target: float, budget: float,
            max_steps: int) -> dict:
  """How a trial did on one link, from its held-out evaluations and its clock.

  The link allows the steps whose clock (`Timeline.known`) fits the budget; within them the
  time to the target is the clock at the first evaluation whose held-out loss is at or below
  the target. A trial that does not get there ended by "budget spent", or by "step cap" when
  every step it trained (`max_steps`) fitted in the budget.

  Returns:
    {"steps": steps in the budget (of those trained), "seconds": their clock,
    "time_to_target", "steps_to_target" (None when not reached), "stopped"}.
  """
  known = np.asarray(known, np.float64)
  eval_steps = np.asarray(eval_steps, np.int64)
  eval_losses = np.asarray(eval_losses, np.float64)
  if eval_steps.shape != eval_losses.shape:
    raise ValueError(f"{eval_steps.size} evaluation steps but {eval_losses.size} losses.")
  steps = sim.steps_within(known, budget)
  hit = np.flatnonzero((eval_steps <= steps) & (eval_losses <= target))
  out = {"steps": steps, "seconds": float(known[steps - 1]) if steps else 0.0,
         "time_to_target": None, "steps_to_target": None}
  if hit.size:
    at = int(eval_steps[hit[0]])
    out.update(time_to_target=float(known[at - 1]), steps_to_target=at, stopped=REACHED)
  else:
    out["stopped"] = CAP if steps >= max_steps else BUDGET
  return out


def _steps_to_try(known: np.ndarray, budget: float, cap: int) -> int:
  """The steps to train to next: the most the clock so far suggests fit in `budget`, plus
  the one that shows it is spent."""
  trained = len(known)
  per_step = known[-1] / trained
  more = math.floor((budget - known[-1]) / per_step) + 1 if per_step > 0 else cap
  return min(cap, trained + max(more, 1))


class Population:
  """The trials of one method at one setting, one per seed (`configs[s]`), built and
  compiled once and trained together in chunks, their held-out loss evaluated every
  `eval_every` steps (untimed). With `together`, one program: `Trainer(trials=S)` (a leading
  trial axis on parameters, state and batch, the local step vmapped; each trial's codec keys
  folded with its seed); otherwise the seeds one after the other, each its own run (the
  fallback for a method whose step cannot be vmapped, and for one seed)."""

  def __init__(self, label: str, setting: int, configs: list, links_: dict, heldout,
               together: bool):
    self.label, self.setting, self.configs, self.heldout = label, setting, configs, heldout
    self.runs = [build.build(c) for c in configs]
    r = self.runs[0]
    size = len(configs) if together else None
    self.trainers = [train.Trainer(
        r.loss_fn, r.optimizer, r.mesh, axis_name=r.axis_name, param_specs=r.specs,
        has_aux=r.has_aux, batch_specs=r.batch_specs, mutable=r.config.model.mutable,
        trials=size) for r in (self.runs[:1] if together else self.runs)]
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
      one = train.Trainer(r.loss_fn, r.optimizer, r.mesh, axis_name=r.axis_name,
                          param_specs=r.specs, has_aux=r.has_aux, batch_specs=r.batch_specs,
                          mutable=r.config.model.mutable)
      state, batch = one.init(r.params), one.shard_batch(r.batches(0))
      report = comm.inspect(one.step_fn(state, batch), state, batch)
    else:
      batch = self._batch(0, 0)
      report = comm.inspect(self.trainers[0].step_fn(self.states[0], batch), self.states[0],
                            batch)
    if (r.config.compare.get("schedule", "constant") != "constant"
        and _schedule.eval_params(self.states[0].params, self.states[0].opt_state) is
        self.states[0].params):
      print(f"  {label}: no inner optimiser (config.optimizer) to make schedule-free; it "
            "runs as its method module builds it.", file=sys.stderr, flush=True)
    self.together = together
    self.report = report
    self.costs = {name: comm.cost(report, link) for name, link in links_.items()}
    self.overlap = build.overlap_steps(r.config.method)
    fn = getattr(r.method, "overlap_backward", None)
    self.overlap_backward = bool(fn(r.config.method)) if fn else False
    self.trials = [Trial(self, s) for s in range(len(configs))]
    self.seconds = 0.0

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

  def _evaluate(self, k: int) -> list:
    """Held-out losses of trainer k's trials: the parameters (a schedule-free optimiser's
    evaluation parameters) averaged over workers."""
    trainer, state = self.trainers[k], self.states[k]
    lead = 1 if trainer.trials else 0
    params = jax.tree.map(lambda x: np.asarray(x),
                          _schedule.eval_params(state.params, state.opt_state))
    views = [jax.tree.map(lambda x, t=t: x[t], params) for t in range(trainer.trials)] \
        if lead else [params]
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
        if (step + 1) % self.configs[0].compare.eval_every == 0:
          for trial, value in zip(owned, self._evaluate(k)):
            trial.evals.append((step + 1, value))
    self.seconds += time.perf_counter() - start

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
    out = {}
    for name, cost in self.costs.items():
      compute, exposed = clock(self, name)
      out[name] = _clock.timeline(compute, self.step_bytes, cost, self.overlap, exposed)
    return out

  def accounts(self, clock, budgets: dict, target: float, cap: int) -> dict:
    steps, losses = (np.array(v) for v in zip(*self.evals)) if self.evals else ([], [])
    return {n: account(steps, losses, t.known, target, budgets[n], cap)
            for n, t in self.clocks(clock).items()}

  def goal(self, clock, budgets: dict, target: float, cap: int) -> int | None:
    """The steps to train to for the links still open (not reached, budget left), or None."""
    timelines = self.clocks(clock)
    done = self.accounts(clock, budgets, target, cap)
    open_links = [n for n, t in timelines.items() if done[n]["stopped"] != REACHED
                  and t.known[-1] <= budgets[n]]
    if not open_links:
      return None
    return max(_steps_to_try(timelines[n].known, budgets[n], cap) for n in open_links)


# ---------------------------------------------------------------- trials of a population
def train_population(label: str, setting: int, configs: list, links_: dict, heldout,
                     steps: int, together: bool = True) -> Population:
  """The trials of one method at one setting, one per seed, trained to `steps`: as one
  program when `together` and there are several seeds, else one after the other; a method
  whose step cannot be vmapped (a ValueError, TypeError or NotImplementedError while it is
  built or traced) falls back to one after the other, and says so on stderr."""
  together = together and len(configs) > 1
  try:
    pop = Population(label, setting, configs, links_, heldout, together)
    pop.train_to(steps)
  except (ValueError, TypeError, NotImplementedError) as e:
    if not together:
      raise
    print(f"  {label}: no population in one program ({type(e).__name__}: "
          f"{str(e).splitlines()[0][:200]}); its seeds run one after the other.",
          file=sys.stderr, flush=True)
    pop = Population(label, setting, configs, links_, heldout, False)
    pop.train_to(steps)
  return pop


def _heldout_fn(config):
  """`params -> held-out loss` on a fixed batch of the test split (the same for every trial:
  one compiled function)."""
  _, loss_fn, has_aux, _, _ = build.model_task(config)
  test = data.load(config.data.name).split()[1]
  batch = test.batch(0, config.compare.eval_batch, seq_len=config.data.seq_len, seed=12345)
  fn = jax.jit(lambda p: loss_fn(p, batch)[0] if has_aux else loss_fn(p, batch))
  return fn


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
  return float(comm.inspect(trainer.step_fn(state, batch), state, batch).wire_bytes())


# ---------------------------------------------------------------- reading all trials
class Clock:
  """Per trial and link: the compute figure of its local step (times `scale`) and, for a
  method overlapped with the backward pass, its exposed communication (cached)."""

  def __init__(self, compute: dict, keys: dict, shares: dict, buckets, links_: dict,
               scale: float = 1.0):
    self.compute, self.keys, self.shares, self.buckets = compute, keys, shares, buckets
    self.links, self.scale, self._exposed = links_, scale, {}

  def seconds(self, trial) -> float:
    return self.compute[self.keys[(trial.label, trial.setting)]]["seconds"] * self.scale

  def __call__(self, trial, link: str):
    compute = self.seconds(trial)
    if not trial.overlap_backward:
      return compute, None
    k = (trial.label, trial.setting, link)
    if k not in self._exposed:
      share = self.shares[self.keys[(trial.label, trial.setting)]]
      self._exposed[k] = _clock.overlapped_comm(trial.report, self.links[link], compute,
                                                share, self.buckets)
    return compute, self._exposed[k]


def reference_setting(trials: list, steps: int) -> tuple[int, list]:
  """The reference's tuned setting (the lowest median over seeds of its best held-out loss
  in `steps` steps) and that setting's best held-out loss per seed."""
  bests = [[min(loss for s, loss in t.evals if s <= steps) for t in seeds] for seeds in trials]
  k = int(np.argmin([np.median(b) for b in bests]))
  return k, bests[k]


def summarise(trials: dict, clock: Clock, target: float, config, budgets=None) -> tuple:
  """(budgets, per-method summary): per link each method's per-study times (the fastest
  setting per study), median, speed-up over the reference with its interval and verdict."""
  c = config.compare
  ref_k = reference_setting(trials[c.reference], config.steps)[0]
  if budgets is None:
    times = {n: [t.accounts(clock, {m: math.inf for m in clock.links}, target,
                            c.max_steps)[n]["time_to_target"]
                 for t in trials[c.reference][ref_k]] for n in clock.links}
    budgets = {n: c.budget * stats.median_time(v) for n, v in times.items()}
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
                       "reached": int(np.isfinite(best).sum())}
  for label in out:
    for n in clock.links:
      s, lo, hi, how = stats.speedup_interval(out[c.reference][n]["study_times"],
                                              out[label][n]["study_times"])
      out[label][n].update(speedup=s, low=lo, high=hi, interval=how,
                           verdict="reference" if label == c.reference
                           else stats.classify(lo, hi))
  return budgets, out, accounts


# ---------------------------------------------------------------- the program
def _workers(config) -> int:
  shape = build.mesh_shape(config.mesh, jax.device_count())
  return math.prod(n for a, n in shape.items() if a not in build.MODEL_AXES)


def _log(verbose: bool, text: str) -> None:
  if verbose:
    print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _compile_cache():
  """A persistent compilation cache for the run (unless the user has one): the trials of one
  method at one setting differ only in array values (the seed), so every seed after the
  first loads the first one's compiled programs instead of compiling them again."""
  if jax.config.jax_compilation_cache_dir:
    yield
    return
  saved = jax.config.jax_persistent_cache_min_compile_time_secs
  with tempfile.TemporaryDirectory(prefix="compare_xla_") as path:
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cc.reset_cache()
    try:
      yield
    finally:
      jax.config.update("jax_compilation_cache_dir", None)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", saved)
      cc.reset_cache()


def _seeded(config, seed: int):
  c = config.copy_and_resolve_references()
  c.seed = config.seed + seed
  return c


def _local_steps(config, configs: dict, compiler) -> tuple[dict, dict]:
  """The local step of each compute key, compiling in the background, and each trial's key."""
  _, loss_fn, _, params, batches = build.model_task(config)
  batch = {k: v[:config.data.batch_size // _workers(config)] for k, v in batches(0).items()}
  keys, steps = {}, {}
  for (label, k), cfg in configs.items():
    key = keys[(label, k)] = _clock.local_step_key(label, cfg)
    if key not in steps:
      fn, args = _clock.local_step(cfg, loss_fn, params, batch, key == _clock.INNER)
      steps[key] = (fn, args, compiler.submit(_clock.compile_step, fn, args))
  return keys, steps, loss_fn, params


def run(config, workdir: str, methods: list | None = None, *,
        verbose: bool = True, catalog: dict | None = None, command: str | None = None) -> dict:
  """Runs the comparison (module docstring), prints the tables and verdicts, writes the
  report, results.json and the figures.

  Args:
    config: what every method shares (model, data, optimizer, the reference's steps;
      experiments/config.py) and how results are read (config.compare); its method is
      replaced by each entry's.
    workdir: where report.md, results.json and the figures go.
    methods: names to run (default: every label of the catalog; see `resolve_methods`).
    verbose: print progress, the tables and the verdicts.
    catalog: label -> METHODS-style entry; default `METHODS`.
    command: the command line, for the report.
  """
  check(config)
  with _compile_cache():
    return _run(config, workdir, methods, verbose, catalog, command)


def _run(config, workdir, methods, verbose, catalog, command) -> dict:
  """`run` inside its compilation cache."""
  links_ = links(config)
  c = config.compare
  entries = resolve_methods(methods, catalog, c.reference)
  settings = {label: settings_list(label, e, c.ruleset) for label, e in entries.items()}
  configs = {(label, k): method_config(config, e) for label, es in settings.items()
             for k, e in enumerate(es)}  # a bad setting fails here, before anything trains
  start_all = time.perf_counter()
  compiler = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  keys, local, loss_fn, params = _local_steps(config, configs, compiler)
  heldout = _heldout_fn(config)

  def population(label, k, steps):
    t0 = time.perf_counter()
    seeds = [_seeded(configs[(label, k)], s) for s in range(c.seeds)]
    pop = train_population(label, k, seeds, links_, heldout, steps, c.population)
    _log(verbose, f"  {label}" + (f" setting {k}" if len(settings[label]) > 1 else "") +
         f": {c.seeds} seeds to step {steps} in {time.perf_counter() - t0:.1f} s"
         f"{' (one program)' if pop.together else ''}")
    return pop

  # The reference's trials set the target and the budgets; then every trial (the
  # reference's too) trains until it reaches the target or spends the budget on every link.
  _log(verbose, f"training on {jax.device_count()} devices ({c.ruleset} ruleset, "
                f"{c.seeds} seeds)...")
  pops = {c.reference: [population(c.reference, k, config.steps)
                        for k in range(len(settings[c.reference]))]}
  trials = {c.reference: [p.trials for p in pops[c.reference]]}
  _log(verbose, "measuring compute per local step...")
  compute = _clock.measure({key: f for key, (_, _, f) in local.items()}, c.compute_repeats)
  compiler.shutdown()
  shares = {key: _clock.shares(loss_fn, fn, args) for key, (fn, args, _) in local.items()}
  clock = Clock(compute, keys, shares, _clock.buckets(params), links_)
  ref_k, bests = reference_setting(trials[c.reference], config.steps)
  if c.target_loss is not None:
    target, source = float(c.target_loss), "given by --target_loss"
  else:
    target = stats.higher_median(bests)
    source = (f"{c.reference}'s best held-out loss in {config.steps} steps, median of "
              f"{c.seeds} seeds")
  budgets, _, _ = summarise({c.reference: trials[c.reference]}, clock, target, config)
  chunk = max(c.eval_every, config.steps // 5)
  for label in entries:
    if label != c.reference:
      pops[label] = [population(label, k, min(chunk, c.max_steps))
                     for k in range(len(settings[label]))]
    for pop in pops[label]:
      pop.train_within(clock, budgets, target, c.max_steps, chunk)
    trials[label] = [p.trials for p in pops[label]]
  _, summary, accounts = summarise(trials, clock, target, config, budgets)
  sensitivity = {scale: summarise(trials, Clock(compute, keys, shares, clock.buckets, links_,
                                                scale), target, config)[1]
                 for scale in (0.8, 1.2)}
  dp_bytes = exact_dp_bytes(config, trials)
  records = [report.record(label, settings[label], entries[label], trials[label],
                           accounts[label], summary[label], clock, dp_bytes)
             for label in entries]
  out = report.write(config, workdir, links_, budgets, target, source, records,
                     {"compute": compute, "shares": shares, "keys": _keys_by_label(keys),
                      "sensitivity": sensitivity, "reference_setting": ref_k,
                      "wall_seconds": time.perf_counter() - start_all}, command)
  if verbose:
    print(out["text"])
    print(f"\nwrote {out['report']}, {os.path.join(workdir, 'results.json')} and "
          f"{', '.join(out['plots'])}")
  return out


def _keys_by_label(keys: dict) -> dict:
  return {f"{label}#{k}": key for (label, k), key in keys.items()}


def main(argv):
  del argv
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  try:
    config = with_flags(_CONFIG.value, _LINKS.value, _LINK.value, _BUDGET.value,
                        _MAX_STEPS.value, ruleset=_RULESET.value, seeds=_SEEDS.value,
                        target_loss=_TARGET.value)
    run(config, _WORKDIR.value, _METHODS.value,
        command=" ".join(["python -m experiments.compare"] + sys.argv[1:]))
  except ValueError as e:  # a user's mistake: one line, no traceback
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
