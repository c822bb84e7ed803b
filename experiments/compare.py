r"""On my link, which method reaches the loss first, and how much sooner than exact DP?

  python -m experiments.compare --workdir=runs/compare          # `make run`: minutes
  python -m experiments.compare --links=wan,internet --link=office:gbit=0.5,latency_ms=40
  python -m experiments.compare --methods=dp,diloco_h10,/path/to/my_method.py --budget=2
  python -m experiments.compare --config=experiments/configs/compare.py:long  # larger, longer

Every method trains the same byte-level transformer LM on the embedded pydoc corpus, on 8
emulated CPU devices, from the same parameters and batches. A method's loss per step does
not depend on the network; only its clock does. So each method trains once, and every
link's clock is read off the same run (`jaxcomm.sim`): one worker's compute per step,
measured on this machine (the method built for one device, timed round-robin with the
others), plus the communication its compiled step's collectives cost on the link
(`comm.inspect`, `comm.cost`) that its schedule cannot hide (a method module's
`overlap_steps`). A step's loss counts from when its result is known
(`sim.Timeline.known`).

Equal time, not equal steps: on each link the budget is the reference's (exact DP's)
simulated time for its `config.steps` steps (times `--budget`), and each method gets the
inner steps that fit in that budget on that link, up to `--max_steps`. A method trains as
many steps as its most generous link allows. The target loss is the reference's smoothed
loss at `target_fraction` of its run (or `target_loss`). For every method and link the
table gives the time to the target, the speed-up over the reference, the steps the budget
allowed and how the method ended: "reached" (at a step), "budget spent" or "step cap" (the
budget was not spent when --max_steps stopped it: never a failure to learn). One verdict
line per link follows. Written into --workdir:
* `report.md`: the tables, verdicts, links and their sources, settings and figures;
* `results.json`: every number (settings, budgets, per-method curves and per-link clocks);
* `loss_vs_time.png`: loss against simulated time, one panel per link, target and budget
  marked; `loss_vs_bytes.png`: loss against cumulative wire bytes per device.

Methods: `METHODS` (labels; `MORE_METHODS` only when named), any method of
experiments/methods/ by name, or a method module of your own as a dotted module path or a
`.py` file (`--methods=dp,/path/my_method.py`; its label is the module's name). A method
module's optional `overlap_steps(settings)` puts its overlap on the clock.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import sys
import time

import numpy as np
from absl import app
from absl import flags

from experiments import config as _config

# label -> the method and its settings (experiments/methods/<method>.py; every setting not
# named keeps the library factory's default), and optionally "optimizer" overrides.
# Local-update methods sync every H = 10 inner steps; a schedule that overlaps communication
# with compute gets its overlap on the simulated clock from its method module's
# `overlap_steps`.
METHODS: dict[str, dict] = {
    "dp": {"method": "dp"},
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
                               "reference's run there (default: config.compare.budget).")
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
  for name in ("smooth", "compute_repeats", "max_steps"):
    _config.int_at_least(config, f"compare.{name}", 1)
  if c.max_steps < config.steps:
    raise ValueError(f"config.compare.max_steps ({c.max_steps}) must be >= config.steps "
                     f"({config.steps}): the reference trains config.steps to set the budget.")
  _config.number_in(config, "compare.budget", 0, math.inf, True, "a finite number > 0")
  if not 0 < c.target_fraction <= 1:
    raise ValueError(f"config.compare.target_fraction must be in (0, 1], got "
                     f"{c.target_fraction}.")
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


def with_flags(config, links_=None, custom=(), budget=None, max_steps=None):
  """`config` with the command line's --links, --link, --budget and --max_steps."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    if links_ is not None or custom:
      c.compare.links = tuple(c.compare.links if links_ is None else links_) + tuple(custom)
    if budget is not None:
      c.compare.budget = float(budget)
    if max_steps is not None:
      c.compare.max_steps = int(max_steps)
  return c


def method_config(config, entry: dict):
  """`config` with the method (and optimizer overrides) of a METHODS entry."""
  entry = dict(entry)
  optimizer = entry.pop("optimizer", {})
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.method = _config.method_config(entry.pop("method"), **entry)
    c.optimizer.update(optimizer)
  return c


def resolve_methods(labels: list | None, catalog: dict | None = None,
                    reference: str = "dp") -> dict:
  """{label: entry} to run, the reference first. A name that is not a catalog label may be a
  method of experiments/methods/, a dotted module path or a `.py` file (a plugin: its label
  is the module's name); anything else is an error naming the allowed values."""
  from experiments import build  # pylint: disable=import-outside-toplevel
  known = {**METHODS, **MORE_METHODS} if catalog is None else catalog
  catalog = METHODS if catalog is None else catalog
  if reference not in catalog:
    raise ValueError(f"config.compare.reference {reference!r} is not a method label; "
                     f"allowed: {', '.join(catalog)}.")
  labels = list(catalog) if labels is None else list(labels)
  chosen = {reference: catalog[reference]}
  for name in labels:
    if name in known:
      label, entry = name, known[name]
    elif name.endswith(".py") or "." in name or name in build.available_methods():
      build.load_method(name)  # a missing file or module fails here, naming it
      label = os.path.splitext(os.path.basename(name))[0].rsplit(".", 1)[-1]
      entry = {"method": name}
    else:
      raise ValueError(f"--methods: {name!r} is unknown; allowed: {', '.join(catalog)}, a "
                       f"method of experiments/methods/ ({', '.join(build.available_methods())}"
                       "), a dotted module path or a .py file.")
    if label in chosen and chosen[label] != entry:
      raise ValueError(f"--methods: two methods are labelled {label!r}.")
    chosen[label] = entry
  return chosen


# ---------------------------------------------------------------- compute per step
def _local_step(config, loss_fn, params, batch):
  """One worker's step (gradient, transform, update) with no communication: the method
  built for one device (axis_name=None), as a jitted function and its arguments."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from experiments import build  # pylint: disable=import-outside-toplevel

  ctx = build.local_context(config)
  tx = build.make_optimizer(config, ctx)
  loss_fn = build.task_loss(config, loss_fn, ctx)

  def step(p, s, b):
    g = jax.grad(loss_fn)(p, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return jax.jit(step), (params, tx.init(params), batch)


def compile_local_step(fn, args) -> tuple:
  """Compiles (by a first call) and returns `(fn, args)`: run in a background thread while
  a method trains, so that XLA's (single-threaded) compile uses the other core."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn(*args))
  return fn, args


def measure_compute(steps: dict, repeats: int) -> dict:
  """Seconds per call of each method's local step, timed round-robin across methods and
  taking each one's fastest call: every method sees the same load on a shared machine, and
  the fastest call is the least disturbed by other programs.

  `steps` maps labels to (fn, args), or to a future of them (`compile_local_step`)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jaxcomm import sim  # pylint: disable=import-outside-toplevel
  steps = {label: s.result() if hasattr(s, "result") else s for label, s in steps.items()}
  for fn, args in steps.values():  # warm up
    jax.block_until_ready(fn(*args))
  best = {label: float("inf") for label in steps}
  for _ in range(repeats):
    for label, (fn, args) in steps.items():
      best[label] = min(best[label], sim.measure_seconds(fn, *args, repeats=1, warmup=0))
  return best


# ---------------------------------------------------------------- the clock and the budget
def clock(compute: float, step_bytes, comm_cost, overlap_steps: int):
  """The simulated timeline of a run on one link (`sim.simulate`): each step's compute plus
  the communication its counted bytes cost (`sim.comm_seconds_per_step`)."""
  from jaxcomm import sim  # pylint: disable=import-outside-toplevel
  comm_s = sim.comm_seconds_per_step(step_bytes, comm_cost)
  return sim.simulate(np.full(len(comm_s), compute), comm_s, overlap_steps=overlap_steps)


def account(smoothed, known, target: float, budget: float, max_steps: int) -> dict:
  """How a run did on one link, from its smoothed loss and its clock (`Timeline.known`).

  The link allows the most steps whose clock fits the budget; within them the time to the
  target is the clock at the first step whose smoothed loss is at or below the target.
  A run that never gets there ended by "budget spent", or by "step cap" when every step it
  trained (`max_steps`) fitted in the budget.

  Returns:
    {"steps": steps allowed, "seconds": their clock, "time_to_target", "steps_to_target"
    (None when not reached), "stopped": "reached" | "budget spent" | "step cap"}.
  """
  from jaxcomm import sim  # pylint: disable=import-outside-toplevel
  smoothed, known = np.asarray(smoothed, np.float64), np.asarray(known, np.float64)
  if smoothed.shape != known.shape:
    raise ValueError(f"smoothed has {smoothed.size} steps but known has {known.size}.")
  steps = sim.steps_within(known, budget)
  hit = np.flatnonzero(smoothed[:steps] <= target)
  out = {"steps": steps, "seconds": float(known[steps - 1]) if steps else 0.0,
         "time_to_target": None, "steps_to_target": None}
  if hit.size:
    out.update(time_to_target=float(known[hit[0]]), steps_to_target=int(hit[0]) + 1,
               stopped=REACHED)
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


# ---------------------------------------------------------------- one method
class _Method:
  """One method's run: built and compiled once, trained in chunks until every link's budget
  is spent (or the step cap), its clock re-read after each chunk."""

  def __init__(self, label: str, config, links_: dict):
    from experiments import build  # pylint: disable=import-outside-toplevel
    from jaxcomm import comm  # pylint: disable=import-outside-toplevel
    self.label, self.config = label, config
    self.run = build.build(config)
    self.trainer = self.run.trainer()
    self.state = self.trainer.init(self.run.params)
    batch0 = self.trainer.shard_batch(self.run.batches(0))
    self.report = comm.inspect(self.trainer.step_fn(self.state, batch0), self.state, batch0)
    self.costs = {name: comm.cost(self.report, link) for name, link in links_.items()}
    self.overlap = build.overlap_steps(config.method)
    self.history, self.seconds = [], 0.0

  @property
  def step_bytes(self) -> np.ndarray:
    return np.array([row["wire_bytes"] for row in self.history], dtype=np.float64)

  def train_to(self, steps: int) -> None:
    from jaxcomm import train  # pylint: disable=import-outside-toplevel
    start = time.perf_counter()
    self.state, history = train.fit(self.trainer, self.state, self.run.batches, steps,
                                    log_every=1, progress=False)
    self.seconds += time.perf_counter() - start
    self.history += history

  def clocks(self, compute: float) -> dict:
    return {name: clock(compute, self.step_bytes, cost, self.overlap)
            for name, cost in self.costs.items()}

  def train_within(self, compute: float, budgets: dict, cap: int, first: int) -> None:
    """Trains until the clock of every link passes its budget, or to `cap` steps."""
    target = min(first, cap)
    while True:
      if target > len(self.history):
        self.train_to(target)
      trained = len(self.history)
      if trained >= cap:
        return
      known = {n: t.known for n, t in self.clocks(compute).items()}
      open_links = [n for n in known if known[n][-1] <= budgets[n]]
      if not open_links:
        return
      target = max(_steps_to_try(known[n], budgets[n], cap) for n in open_links)


# ---------------------------------------------------------------- results
def _record(m: _Method, compute: float, budgets: dict, target: float, cap: int) -> dict:
  """A method's results: its curve up to the steps its most generous link allowed, and per
  link its clock, budget, steps and time to the target."""
  from jaxcomm import comm, sim  # pylint: disable=import-outside-toplevel
  config, smooth = m.config, m.config.compare.smooth
  losses = np.array([row["loss"] for row in m.history])
  smoothed = sim.smooth(losses, smooth)
  timelines = m.clocks(compute)
  per_link = {n: account(smoothed, t.known, target, budgets[n], cap)
              for n, t in timelines.items()}
  steps = max(a["steps"] for a in per_link.values())
  step_bytes = m.step_bytes[:steps]
  dp_bytes = comm.allreduce_bytes(comm.tree_bytes(m.run.params), m.trainer.num_workers)
  per_step = float(step_bytes.mean()) if steps else 0.0
  record = {
      "method": m.label, "algo": config.method.name, "settings": config.method.to_dict(),
      "optimizer": config.optimizer.to_dict(), "workers": m.trainer.num_workers,
      "overlap_steps": m.overlap, "compute_seconds_per_step": compute,
      "trained_steps": len(m.history), "steps": steps,
      "final_loss": float(smoothed[steps - 1]) if steps else None,
      "wire_bytes_per_step": per_step, "dp_wire_bytes_per_step": dp_bytes,
      "compression_ratio": dp_bytes / per_step if per_step else None,
      "inspected_wire_bytes": {"every_step": m.report.wire_bytes(conditional=False),
                               "conditional": m.report.wire_bytes(conditional=True)},
      "train_seconds_emulated": m.seconds,
      "curve": {"step": [row["step"] for row in m.history[:steps]],
                "loss": losses[:steps].tolist(), "smoothed_loss": smoothed[:steps].tolist(),
                "wire_bytes": step_bytes.tolist(),
                "cumulative_wire_bytes": np.cumsum(step_bytes).tolist()},
      "links": {},
  }
  for name, timeline in timelines.items():
    a = per_link[name]
    n = a["steps"]
    serial = sim.simulate(timeline.compute_seconds[:n], timeline.comm_seconds[:n]).total
    record["links"][name] = {
        **a, "budget_seconds": budgets[name],
        "final_loss": float(smoothed[n - 1]) if n else None,
        "seconds_without_overlap": serial,
        "exposed_comm_seconds": a["seconds"] - compute * n,
        "comm_seconds_per_step": float(timeline.comm_seconds[:n].mean()) if n else 0.0,
        # The clock of every step of the curve (the steps beyond n exceed this budget).
        "comm_seconds": timeline.comm_seconds[:steps].tolist(),
        "time": timeline.known[:steps].tolist()}
  return record


def pick_target(losses, config) -> tuple[float, str]:
  """The target loss: config.compare.target_loss, or the reference's smoothed loss at
  target_fraction of its config.steps."""
  from jaxcomm import sim  # pylint: disable=import-outside-toplevel
  c = config.compare
  if c.target_loss is not None:
    return float(c.target_loss), "given by config.compare.target_loss"
  idx = max(int(math.ceil(c.target_fraction * config.steps)) - 1, 0)
  smoothed = sim.smooth(losses[:config.steps], c.smooth)
  return (float(smoothed[idx]),
          f"{c.reference}'s smoothed loss at step {idx + 1} of its {config.steps}")


def add_speedups(results: list, reference: str) -> None:
  """Each method's time to the target on a link, as a speed-up over the reference's."""
  ref = next(r for r in results if r["method"] == reference)
  for r in results:
    for name, link in r["links"].items():
      base, mine = ref["links"][name]["time_to_target"], link["time_to_target"]
      link["speedup"] = base / mine if base and mine else None


# ---------------------------------------------------------------- the program
def _workers(config) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  from experiments import build  # pylint: disable=import-outside-toplevel
  shape = build.mesh_shape(config.mesh, jax.device_count())
  return math.prod(n for a, n in shape.items() if a not in build.MODEL_AXES)


def _log(verbose: bool, text: str) -> None:
  if verbose:
    print(text, file=sys.stderr, flush=True)


def run(config, workdir: str, methods: list | None = None, *,
        verbose: bool = True, catalog: dict | None = None, command: str | None = None) -> dict:
  """Runs the comparison, prints the tables and verdicts, writes the report, results.json
  and the plots.

  Args:
    config: what every method shares (model, data, optimizer, the reference's steps;
      experiments/config.py) and how results are read (config.compare); its method is
      replaced by each entry's.
    workdir: where report.md, results.json and the plots go.
    methods: names to run (default: every label of the catalog; see `resolve_methods`).
    verbose: print progress, the tables and the verdicts.
    catalog: label -> METHODS-style entry; default `METHODS`.
    command: the command line, for the report.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from experiments import _compare_report as report  # pylint: disable=import-outside-toplevel
  from experiments import build  # pylint: disable=import-outside-toplevel

  check(config)
  links_ = links(config)
  c = config.compare
  entries = resolve_methods(methods, catalog, c.reference)
  configs = {label: method_config(config, entry) for label, entry in entries.items()}
  # Each method's own compute, built now (a bad setting fails before anything trains) and
  # compiled in the background while the reference trains.
  _, loss_fn, _, params, batches = build.model_task(config)
  local_batch = {k: v[:config.data.batch_size // _workers(config)]
                 for k, v in batches(0).items()}
  compiler = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  local = {label: compiler.submit(compile_local_step, *_local_step(cfg, loss_fn, params,
                                                                    local_batch))
           for label, cfg in configs.items()}

  # The reference's config.steps set each link's budget; then every method (the reference
  # too, when --budget > 1) trains what its most generous link allows.
  labels = list(configs)
  runs, compute, budgets = {}, None, None
  for label in labels:
    start = time.perf_counter()
    _log(verbose, f"training {label} on {jax.device_count()} devices...")
    m = runs[label] = _Method(label, configs[label], links_)
    if compute is None:
      m.train_to(config.steps)
      _log(verbose, "measuring compute per step...")
      compute = measure_compute(local, c.compute_repeats)
      compiler.shutdown()
      budgets = {n: c.budget * t.known[config.steps - 1]
                 for n, t in m.clocks(compute[label]).items()}
    m.train_within(compute[label], budgets, c.max_steps, first=max(config.steps // 4, 1))
    _log(verbose, f"  {label}: {len(m.history)} steps, loss "
                  f"{np.mean([r['loss'] for r in m.history[-c.smooth:]]):.4f} after "
                  f"{time.perf_counter() - start:.1f} s (compiles included)")
  ref = runs[c.reference]
  target, target_source = pick_target([row["loss"] for row in ref.history], config)
  results = [_record(runs[label], compute[label], budgets, target, c.max_steps)
             for label in labels]
  add_speedups(results, c.reference)
  summary = report.write(config, workdir, links_, budgets, target, target_source, results,
                         command)
  if verbose:
    print(summary["text"])
    print(f"\nwrote {summary['report']}, {os.path.join(workdir, 'results.json')} and "
          f"{', '.join(summary['plots'])}")
  return summary


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  try:
    config = with_flags(_CONFIG.value, _LINKS.value, _LINK.value, _BUDGET.value,
                        _MAX_STEPS.value)
    run(config, _WORKDIR.value, _METHODS.value,
        command=" ".join(["python -m experiments.compare"] + sys.argv[1:]))
  except ValueError as e:  # a user's mistake: one line, no traceback
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
