r"""On my link, which method reaches the held-out loss first, and how much sooner than a
strong data-parallel reference? A benchmark protocol after MLCommons AlgoPerf.

  python -m experiments.compare --workdir=runs/compare          # `make run`
  python -m experiments.compare --scale=proxy                   # the proxy's own clock
  python -m experiments.compare --model=gpt2_124m --sites=4 --per_site=16 --mfu=0.35
  python -m experiments.compare --ruleset=tuned --seeds=3       # each method's best setting
  python -m experiments.compare --links=wan,internet --link=office:gbit=0.5,latency_ms=40
  python -m experiments.compare --proxies=2                     # the transfer check
  python -m experiments.compare --failures=llama3               # and when devices fail
  python -m experiments.compare --methods=dp_bf16,diloco_h10,/path/to/my_method.py
  python -m experiments.compare --config=experiments/configs/compare.py:long  # larger, longer

Every method trains the same byte-level transformer LM (the proxy) on the train split of the
embedded pydoc corpus, on 8 emulated CPU devices. A trial is one method at one setting and
one seed (the seed sets the initial parameters, the batches and the codecs' keys). A trial's
losses do not depend on the network, only its clock does, so each trial trains once and
every link's clock is read off it (`jaxcomm.sim`).

* At a scenario's scale (`--scale=scenario`, the default; `experiments/compare/scale.py`):
  a model at its size (`--model`: a preset of experiments/configs/models/ or a .py file of
  that form) on S sites x d devices (`--sites`, `--per_site`; mesh `replica=S,fsdp=d`),
  `--inside` a site, an accelerator at an MFU (`--device`, `--mfu`, or `--compute_seconds`);
  `--links` are the links between the sites (a per-site bandwidth such as wan's is shared by
  the site's devices that send at once, `jaxcomm.comm.Sites`). Each method's step is
  compiled at that size on that mesh, never run (`jaxcomm.plan`); its step time is its
  FLOPs / (peak x MFU) plus its collectives on the two-level network. The proxy trains with
  one replica per site (`replica=S,data=8/S`): steps to the target come from the proxy,
  the time to the target is the scenario's clock at those steps. report.md also gives the
  verdicts on the proxy's own clock (the regime's effect).
* `--scale=proxy`: one measured compute figure per local step (`clock.py`: methods with
  the same local step share it) plus the proxy's compiled step on each link, per device.

Either way a method's communication is charged less what its schedule cannot hide: a method
module's `overlap_steps` (later steps overlap a sync) or `overlap_backward` (the all-reduce
overlaps the backward pass bucket by bucket, `sim.backward_overlap`).

* Reference: on each link the faster (lower median time to the target) of
  `config.compare.reference_pool`: bf16 DP (`dp_bf16`, `config.compare.reference`) and f32
  DP (`dp`), both with their all-reduce overlapped with the backward pass. bf16 DP halves
  the bytes but, to accumulate in f32, travels as two collectives (all-to-all of bf16
  chunks, f32 sums, all-gather of bf16); a single bf16 all-reduce would accumulate in bf16.
  Where latency dominates, f32 DP's one all-reduce is faster: the strong reference is
  whichever is faster on the link, and both stay in the table.
* Target: the held-out loss (the test split, untimed) that `config.compare.reference`
  reaches: the median over seeds of its best held-out loss in `config.steps` steps at its
  tuned setting (the higher middle value for an even number of seeds, so that most seeds
  reach it); `--target_loss` overrides it.
* Evaluations: at fixed intervals of simulated time on each link: the first step whose
  clock reaches each multiple of the reference's time for `eval_every` steps there
  (`experiments/compare/account.py`: on a step grid a method with slow steps would be
  read at coarser times), at step 0, and at the last step when the step cap stops a trial
  (a trial is never a miss for want of a reading: with none in the budget it is "not
  evaluated"). The steps to the target are interpolated between the two readings around
  it, and its time is the clock there. Once the target is known, a trial's evaluations on a
  link stop after its first one there at or below the target: later ones change no time.
* Budget per link: `budget` times that link's reference's median time to the target (2 by
  default, not AlgoPerf's 4/3: local-update methods learn less per step, and twice the
  reference's time still times a method half as fast instead of calling it a miss).
  A trial trains until it has reached the target or spent the budget on every link, or
  `max_steps`.
* A method's time on a link is the median over seeds of its time to the target (a miss
  counts as infinity); its speed-up over the reference is the geometric mean of the paired
  per-seed speed-ups with a 95 % t-interval on their logarithms
  (`experiments/compare/stats.py`; a miss counts as the budget; its coverage is measured in
  tests/test_compare_stats.py), and it is called faster only when the interval excludes 1.
  When the interval of the two fastest methods' ratio contains 1, the verdict names them as
  tied.
* Schedule (`config.compare.schedule`): `constant` (config.optimizer's learning rate), or
  `schedule_free`: every method's inner optimiser made schedule-free (Defazio et al., arXiv
  2405.15682; `warmup_steps` of linear warmup, no decay to place before a link's budget
  ends, so each trial still trains once for every link), its held-out loss read at the
  schedule-free evaluation parameters (`experiments/compare/schedule.py`). A method
  without an inner optimiser (DeMo) runs as its module builds it, and says so on stderr.
  Or `wsd`: the trials are the warmup and stable phase; per link a decay branches from the
  state kept at `1 - decay_fraction` of the budget and ends with it, and the report sets
  the held-out loss at the budget with and without it side by side
  (`experiments/compare/wsd.py`).
* `--ruleset=default`: each method's settings as `METHODS` has them, S seeds.
  `--ruleset=tuned`: each method module's `tuning()` list (at most 5 settings, the same on
  every link), S studies; per study and link the fastest setting's time, then the median
  over studies.

`--proxies=2` runs it again with a proxy of >= 4x the parameters and compares each method's
steps to the target relative to DP's at the two sizes (`transfer.py`).

`--failures=<preset>|<settings>` (`jaxcomm.sim.FAILURE_PRESETS` or `mtbf_h=...,restart_s=...`;
default none) adds a second score (`failures.py`): per link each method's time to the
target and goodput under that failure model (`config.compare.failure_draws` seeded draws
per training seed; each method as its module's `failure_semantics` declares), verdict lines
that name the score, and a second performance profile.

Written into --workdir: `report.md` (the scenario, verdicts with intervals and seed counts,
the verdicts on the proxy's own clock, a table per link, per-seed times, each method's step
at scale (or the measured compute figures), a sensitivity line per link at compute
+-20 %, the performance profile's area and the geometric-mean speed-up),
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
from jax.experimental.compilation_cache import compilation_cache as cc

from .. import config as _config
from . import clock as _clock
from . import failures as failures_
from . import report
from . import scale as scale_
from . import scale_report
from . import settings as settings_
from . import stats
from . import summary as summary_
from . import transfer
from . import trials as trials_
from .timing import step_time  # noqa: F401 (one method's step at scale, for other scores)
from . import wsd as _wsd

# label -> the method and its settings (experiments/methods/<method>.py; every setting not
# named keeps the library factory's default), and optionally "optimizer" overrides.
# Local-update methods sync every H = 10 inner steps; a schedule that overlaps communication
# with compute gets its overlap on the simulated clock from its method module's
# `overlap_steps` / `overlap_backward`.
METHODS: dict[str, dict] = {
    # Exact (f32) data parallelism, its all-reduce overlapped with the backward pass.
    "dp": {"method": "dp"},
    # bf16 data parallelism, overlapped the same way; with dp, the reference pool.
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
# every period K_x; Muon, its variants, gossip DiLoCo and Pier at their modules' defaults).
MORE_METHODS: dict[str, dict] = {
    "diloco_h10_eager": {"method": "diloco", "sync_every": 10, "eager": True},
    "des_loc_k10": {"method": "des_loc", "sync_every": 10},
    "local_adam_k10": {"method": "des_loc", "sync_every": 10, "state_every": "mu=10,nu=10"},
    "noloco_h10": {"method": "noloco", "sync_every": 10}, "muon": {"method": "muon"},
    "dion_f4": {"method": "dion"}, "dion2_a25": {"method": "dion2"}, "pier_h10": {"method": "pier"},
    "muonbp_p5": {"method": "muonbp"}, "gasloc_h10": {"method": "gasloc"},
    "factored_gossip_h10": {"method": "factored_gossip_diloco", "blocking_every": 2},
}

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



# ---------------------------------------------------------------- the program
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


def run(config, workdir: str, methods: list | None = None, *,
        verbose: bool = True, catalog: dict | None = None, command: str | None = None,
        method_settings: dict | None = None) -> dict:
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
    method_settings: method settings (`--config.method.<setting>`) set in every method that
      has them (`config.with_settings`).
  """
  settings_.check(config)
  entries = _config.with_settings(resolve_methods(methods, catalog, config.compare.reference),
                                  method_settings)
  with _compile_cache():
    out = _run(config, workdir, entries, verbose, command)
    if config.compare.proxies == 2:  # the transfer check: again with a larger proxy
      transfer.check(config, workdir, out, verbose, lambda c, path: _run(
          c, path, entries, verbose, command))
    return out


def _run(config, workdir, entries, verbose, command) -> dict:
  """`run` inside its compilation cache, on the resolved `entries`."""
  config = settings_.at_scale(config)
  links_ = settings_.links(config)
  c = config.compare
  at_scale = c.scale == "scenario"
  settings = {label: settings_.settings_list(label, e, c.ruleset)
              for label, e in entries.items()}
  configs = {(label, k): settings_.method_config(config, e) for label, es in settings.items()
             for k, e in enumerate(es)}  # a bad setting fails here, before anything trains
  start_all = time.perf_counter()
  if at_scale:  # every method's step at the scenario's size, planned while the proxy trains
    sc = scale_.scenario(config)
    planner = scale_.Planner(configs, sc, lambda text: _log(verbose, text))
  else:
    compiler = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    keys, local, loss_fn, params = _clock.local_steps(config, configs, compiler)
  heldout = trials_.heldout_fn(config)

  def population(label, k, steps, grid=None, watch=None, target=None):
    t0 = time.perf_counter()
    seeds = [settings_.seeded(configs[(label, k)], s) for s in range(c.seeds)]
    pop = trials_.train_population(label, k, seeds, links_, heldout, steps, c.population,
                                   grid, watch, target)
    _log(verbose, f"  {label}" + (f" setting {k}" if len(settings[label]) > 1 else "") +
         f": {c.seeds} seeds to step {steps} in {time.perf_counter() - t0:.1f} s"
         f"{' (one program)' if pop.together else ''}")
    return pop

  # The reference's first `eval_every` steps (the pool's, which may stand as the reference
  # on a link) while the local steps compile (or the steps at scale are planned); their
  # clock there sets each link's interval between held-out evaluations. Then the pool
  # trains `config.steps` (which set the target) and on until it reaches the target (its
  # times set each link's reference and budget); then every trial trains until it reaches
  # the target or spends the budget on every link.
  _log(verbose, f"training on {jax.device_count()} devices, mesh {config.mesh or 'data=all'} "
                f"({c.ruleset} ruleset, {c.seeds} seeds)...")
  first = summary_.pool(config, entries)
  pops = {label: [population(label, k, c.eval_every) for k in range(len(settings[label]))]
          for label in first}
  not_planned = {}
  if at_scale:  # the pool's readings need no clock (every eval_every steps): train on
    for pop in (p for ps in pops.values() for p in ps):
      pop.train_to(config.steps)
    _log(verbose, "waiting for the steps planned at scale...")
    clock, not_planned = planner.clock(links_, first)
    entries = {label: e for label, e in entries.items() if label not in not_planned}
    compute = shares = keys = None
  else:
    _log(verbose, "measuring compute per local step...")
    compiled = {key: f.result() for key, (_, _, f) in local.items()}
    compute = _clock.measure(compiled, c.compute_repeats)
    compiler.shutdown()
    shares = _clock.all_shares(loss_fn, compiled)
    clock = _clock.Clock(compute, keys, shares, _clock.buckets(params), links_)
  # Readings: at scale every eval_every steps (the steps to the target are the proxy's, the
  # same on every link); on the proxy's clock also on each link's grid of simulated time.
  grid = (clock, {n: math.inf for n in links_} if at_scale else _clock.intervals(
      [t for p in pops[c.reference] for t in p.trials], clock, c.eval_every))
  for pop in (p for ps in pops.values() for p in ps):
    pop.evaluate_on(*grid)
    pop.train_to(config.steps)
  trials = {label: [p.trials for p in ps] for label, ps in pops.items()}
  ref_k, bests = summary_.reference_setting(trials[c.reference], config.steps)
  if c.target_loss is not None:
    target, source = float(c.target_loss), "given by --target_loss"
  else:
    target = stats.higher_median(bests)
    source = (f"{c.reference}'s best held-out loss in {config.steps} steps, median of "
              f"{c.seeds} seeds")
  chunk = c.eval_every  # trained between checks: a trial stops within one reading of done
  for pop in (p for ps in pops.values() for p in ps):
    pop.aim(target)  # evaluations that cannot change a time to the target are skipped
  for label, ps in pops.items():  # the pool's times (at its tuned setting) set the budgets
    ps[summary_.reference_setting(trials[label], config.steps)[0]].train_until_reached(
        clock, target, c.max_steps, chunk)
  budgets, refs = summary_.budgets_and_references(trials, clock, target, config)
  wsd = c.schedule == "wsd"
  watch = _wsd.watch(budgets, c.decay_fraction, c.max_steps) if wsd else None
  for pop in (p for ps in pops.values() for p in ps):
    if watch:
      pop.watch, pop.watch_step = dict(watch["links"]), watch["step"]
  for label in entries:
    if label not in pops:
      pops[label] = [population(label, k, min(chunk, c.max_steps), grid, watch, target)
                     for k in range(len(settings[label]))]
    for pop in pops[label]:
      pop.train_within(clock, budgets, target, c.max_steps, chunk)
    trials[label] = [p.trials for p in pops[label]]
  trials = {label: trials[label] for label in entries}  # the table's order
  _, summary, accounts = summary_.summarise(trials, clock, target, config, budgets, refs)
  sensitivity = {factor: summary_.summarise(trials, clock.scaled(factor), target, config)[1]
                 for factor in (0.8, 1.2)}
  decays = None
  if wsd:  # the decay branches (trials may train on to a branch point: after the summary)
    _log(verbose, "decay branches per link (warmup-stable-decay)...")
    found = _wsd.branches(pops, budgets, c.max_steps, chunk, links_)
    decays = {"branches": found, "summary": _wsd.summary(found, list(links_))}
  dp_bytes = summary_.exact_dp_bytes(config, trials)
  records = [report.record(label, settings[label], entries[label], trials[label],
                           accounts[label], summary[label], clock, dp_bytes)
             for label in entries]
  extra = {"compute": compute, "shares": shares,
           "keys": _keys_by_label(keys) if keys else None,
           "sensitivity": sensitivity, "reference_setting": ref_k,
           "intervals": grid[1], "references": refs, "wsd": decays, "not_planned": not_planned}
  if at_scale:  # the scenario's step times, and the same trials on the proxy's own clock
    extra.update(scale_report.extra(clock, sc, links_, {m: pops[m] for m in entries}, trials,
                                    target, config, not_planned, records))
  extra["failures"] = failures_.extra(records, list(links_), c.failures, c.failure_draws,
                                      sc.devices if at_scale else jax.device_count(), refs,
                                      target)  # the second score (None without --failures)
  extra["wall_seconds"] = time.perf_counter() - start_all
  out = report.write(config, workdir, links_, budgets, target, source, records, extra, command)
  if verbose:
    print(out["text"])
    print(f"\nwrote {out['report']}, {os.path.join(workdir, 'results.json')} and "
          f"{', '.join(out['plots'])}")
  return out


def _keys_by_label(keys: dict) -> dict:
  return {f"{label}#{k}": key for (label, k), key in keys.items()}
