r"""Compares communication methods on the LM: loss, wire bytes and simulated time on networks.

  python -m experiments.compare --workdir=runs/compare          # default: minutes
  python -m experiments.compare --config=experiments/configs/compare.py:long  # larger, longer
  python -m experiments.compare --methods=dp,diloco_h10 --config.steps=300

Every method trains the same byte-level transformer LM on the embedded pydoc corpus, on 8
emulated CPU devices, for the same number of inner steps, from the same initial parameters
and the same batches. For each method it records the loss and the wire bytes counted at
every step, reads the compiled step's collectives (`comm.inspect`), measures one worker's
compute per step on this machine (the method built for one device, no communication), and
puts the run on a simulated clock (`jaxcomm.sim`) for each network preset: compute plus the
communication the method's schedule cannot hide. It prints one table and writes into
--workdir:
* `results.json`: every number (settings, per-method summaries and per-step curves);
* `loss_vs_time.png`: loss against simulated time, one panel per network;
* `loss_vs_bytes.png`: loss against cumulative wire bytes per device.

The target loss (unless config.compare.target_loss is given) is the smoothed loss exact data
parallelism reaches at config.compare.target_fraction of its steps, so that DP reaches it by construction and every
other method is timed to the same quality. A target a method never reaches is reported as
"not reached", never as a time.

Every run is built by experiments/build.py from the config (experiments/configs/compare.py)
with its method replaced by a `METHODS` entry: exact DP in float32 and bfloat16, PowerSGD,
top-k, int8 and QSGD with error feedback, DeMo, DiLoCo, Streaming DiLoCo and ACCO.
Overlapping schedules (Streaming DiLoCo, ACCO) hide communication behind later steps' compute
on the simulated clock (each method module's `overlap_steps`); results.json also gives each
run's time with nothing hidden (`total_seconds_without_overlap`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
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
# Local-update methods sync every H = 10 of the default 150 inner steps (15 syncs); a
# schedule that overlaps communication with compute gets its overlap on the simulated clock
# from its method module's `overlap_steps`.
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
    # QSGD, 4-bit codes (s = 7 levels and a sign) with a norm per 64-element bucket, with
    # error feedback, two-phase.
    "qsgd4_ef": {"method": "compressed", "codec": "qsgd:7,bucket=64", "memory": "ef",
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

_WORKDIR = flags.DEFINE_string("workdir", "runs/compare", "Where results and plots go.")
_METHODS = flags.DEFINE_list("methods", None, "Method labels to compare (default: all of "
                             "METHODS).")
_CONFIG = _config.define_config_flag(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "compare.py"),
    "What every method shares (model, data, optimizer, steps) and how results are read "
    "(config.compare); `configs/compare.py:long` for the longer run.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices.")


def check(config) -> None:
  """The comparison's own settings (config.compare); the rest is experiments.config.check."""
  from experiments import config as _config  # pylint: disable=import-outside-toplevel
  _config.check(config)
  c = config.compare
  for name in ("smooth", "compute_repeats"):
    if isinstance(c[name], bool) or not isinstance(c[name], int) or c[name] < 1:
      raise ValueError(f"config.compare.{name} must be an integer >= 1, got {c[name]!r}.")
  if not 0 < c.target_fraction <= 1:
    raise ValueError(f"config.compare.target_fraction must be in (0, 1], got "
                     f"{c.target_fraction}.")
  if c.target_loss is not None and not math.isfinite(c.target_loss):
    raise ValueError(f"config.compare.target_loss must be finite, got {c.target_loss}.")


def method_config(config, entry: dict):
  """`config` with the method (and optimizer overrides) of a METHODS entry."""
  from experiments import config as _config  # pylint: disable=import-outside-toplevel
  entry = dict(entry)
  optimizer = entry.pop("optimizer", {})
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.method = _config.method_config(entry.pop("method"), **entry)
    c.optimizer.update(optimizer)
  return c


def resolve_methods(labels: list | None, catalog: dict | None = None) -> list:
  """The labels to run (default: all of the catalog); unknown labels are an error."""
  catalog = METHODS if catalog is None else catalog
  labels = list(catalog) if labels is None else list(labels)
  unknown = [l for l in labels if l not in catalog]
  if unknown:
    raise ValueError(f"methods {unknown} are unknown; allowed: {', '.join(catalog)}.")
  return labels


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
  the next method trains, so that XLA's (single-threaded) compile uses the other core."""
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


def train_method(label: str, config) -> tuple[dict, dict]:
  """Trains one method (`config`, built through experiments.build); returns its record and
  what the simulation needs."""
  from experiments import build  # pylint: disable=import-outside-toplevel
  from jaxcomm import comm, sim, train  # pylint: disable=import-outside-toplevel

  run = build.build(config)
  trainer = run.trainer()
  state = trainer.init(run.params)
  batch0 = trainer.shard_batch(run.batches(0))
  report = comm.inspect(trainer.step_fn(state, batch0), state, batch0)
  start = time.perf_counter()
  state, history = train.fit(trainer, state, run.batches, run.steps, log_every=1,
                             progress=False)
  train_seconds = time.perf_counter() - start
  losses = np.array([row["loss"] for row in history])
  step_bytes = np.array([row["wire_bytes"] for row in history], dtype=np.float64)
  workers = trainer.num_workers
  local = {k: v[:config.data.batch_size // workers] for k, v in run.batches(0).items()}
  dp_bytes = comm.allreduce_bytes(comm.tree_bytes(run.params), workers)
  per_step = float(step_bytes.mean())
  smoothed = sim.smooth(losses, config.compare.smooth)
  record = {
      "method": label, "algo": config.method.name, "settings": config.method.to_dict(),
      "optimizer": config.optimizer.to_dict(), "workers": workers,
      "steps": run.steps, "final_loss": float(smoothed[-1]),
      "wire_bytes_per_step": per_step, "dp_wire_bytes_per_step": dp_bytes,
      "compression_ratio": dp_bytes / per_step if per_step else None,
      "inspected_wire_bytes": {"every_step": report.wire_bytes(conditional=False),
                               "conditional": report.wire_bytes(conditional=True)},
      "overlap_steps": build.overlap_steps(config.method),
      "train_seconds_emulated": train_seconds,
      "curve": {"step": [row["step"] for row in history], "loss": losses.tolist(),
                "smoothed_loss": smoothed.tolist(),
                "cumulative_wire_bytes": np.cumsum(step_bytes).tolist()},
      "networks": {},
  }
  sim_inputs = {"report": report, "step_bytes": step_bytes,
                "local_step": _local_step(config, run.model_loss_fn, run.params, local)}
  return record, sim_inputs


def simulate_method(record: dict, report, step_bytes, compute: float, config) -> None:
  """Puts a trained method on the simulated clock of every network (fills record)."""
  from jaxcomm import comm, sim  # pylint: disable=import-outside-toplevel
  record["compute_seconds_per_step"] = compute
  for network in config.compare.networks:
    comm_s = sim.comm_seconds_per_step(step_bytes, comm.cost(report, network))
    timeline = sim.simulate(compute, comm_s, overlap_steps=record["overlap_steps"])
    # The same run with nothing hidden: what the method's overlap saves.
    serial = sim.simulate(compute, comm_s).total
    record["networks"][network] = {
        "comm_seconds_per_step": float(comm_s.mean()), "total_seconds": timeline.total,
        "total_seconds_without_overlap": serial,
        "exposed_comm_seconds": timeline.exposed_comm,
        # With overlap, a step that sends nothing can be done before an earlier step's
        # communication is: a step's loss counts from when it and every earlier step are
        # done, so that the clock of the curve runs forward.
        "time": np.maximum.accumulate(timeline.done).tolist()}


def pick_target(results: list, config) -> tuple[float, str]:
  if config.compare.target_loss is not None:
    return float(config.compare.target_loss), "given by --target_loss"
  ref = next((r for r in results if r["method"] == "dp"), results[0])
  idx = max(int(math.ceil(config.compare.target_fraction * len(ref["curve"]["loss"]))) - 1, 0)
  return (float(ref["curve"]["smoothed_loss"][idx]),
          f"{ref['method']}'s smoothed loss at step {idx + 1} of {len(ref['curve']['loss'])}")


def add_time_to_target(results: list, target: float, config) -> None:
  from jaxcomm import sim  # pylint: disable=import-outside-toplevel
  for r in results:
    for net in r["networks"].values():
      net["time_to_target"] = sim.time_to_target(r["curve"]["loss"], net["time"], target,
                                                 window=config.compare.smooth)


def _fmt_time(seconds: float | None) -> str:
  if seconds is None:
    return "not reached"
  return f"{seconds:,.1f} s" if seconds >= 1 else f"{seconds * 1e3:,.1f} ms"


def table(results: list, config, target: float) -> str:
  """One row per method: final loss, bytes, ratio, and per network the simulated time to
  the target loss and of the whole run (every method runs the same number of steps)."""
  nets = list(config.compare.networks)
  steps = results[0]["steps"] if results else config.steps
  head = (f"{'method':<14}{'final loss':>11}{'bytes/step':>12}{'ratio':>8}"
          + "".join(f"{'to ' + format(target, '.3f') + ' ' + n:>23}"
                    f"{str(steps) + ' steps ' + n:>21}" for n in nets))
  rows = [head, "-" * len(head)]
  for r in results:
    ratio = f"{r['compression_ratio']:.2f}x" if r["compression_ratio"] else "inf"
    rows.append(f"{r['method']:<14}{r['final_loss']:>11.4f}{r['wire_bytes_per_step']:>12,.0f}"
                f"{ratio:>8}"
                + "".join(f"{_fmt_time(r['networks'][n]['time_to_target']):>23}"
                          f"{_fmt_time(r['networks'][n]['total_seconds']):>21}" for n in nets))
  return "\n".join(rows)


# Line style by kind of method, so that ten curves stay apart beyond their colours.
_STYLES = {"dp": "-", "compressed": "--", "powersgd": "--", "demo": "--",
           "diloco": "-.", "streaming_diloco": "-.", "acco": ":", "delayed": ":"}


def _style(i: int, record: dict) -> dict:
  import matplotlib  # pylint: disable=import-outside-toplevel
  colors = matplotlib.colormaps["tab10"].colors + matplotlib.colormaps["Dark2"].colors
  return {"color": colors[i % len(colors)], "linestyle": _STYLES.get(record["algo"], "-"),
          "linewidth": 2.0 if record["method"] == "dp" else 1.4, "label": record["method"]}


def _finish(fig, ax, target: float) -> None:
  """Target line, and one legend beside the plot for every curve."""
  ax.axhline(target, color="black", linestyle=(0, (1, 3)), linewidth=1,
             label=f"target loss {target:.3f}")
  handles, labels = ax.get_legend_handles_labels()
  fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)


def plot(results: list, config, target: float, workdir: str) -> list:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  paths = []
  nets = list(config.compare.networks)
  fig, axes = plt.subplots(1, len(nets), figsize=(5.5 * len(nets) + 1.8, 4.5), squeeze=False)
  for ax, network in zip(axes[0], nets):
    for i, r in enumerate(results):
      ax.plot(r["networks"][network]["time"], r["curve"]["smoothed_loss"], **_style(i, r))
    ax.set_xscale("log")
    ax.set_xlabel(f"simulated wall clock on '{network}' (s, log scale)")
    ax.set_ylabel(f"training loss (mean of last {config.compare.smooth} steps)")
    ax.set_title(f"loss vs time: {network}")
    ax.grid(True, alpha=0.3)
  _finish(fig, axes[0][0], target)
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
    ax.plot(sent[keep], np.asarray(r["curve"]["smoothed_loss"])[keep], **_style(i, r))
  ax.set_xscale("log")
  ax.set_xlabel("cumulative wire bytes sent per device (log scale)")
  ax.set_ylabel(f"training loss (mean of last {config.compare.smooth} steps)")
  ax.set_title("loss vs communication")
  ax.grid(True, alpha=0.3)
  _finish(fig, ax, target)
  fig.tight_layout(rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1))
  paths.append(os.path.join(workdir, "loss_vs_bytes.png"))
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def run(config, workdir: str, methods: list | None = None, *,
        verbose: bool = True, catalog: dict | None = None) -> dict:
  """Runs the comparison, prints the table and writes results.json and the plots.

  Args:
    config: what every method shares (model, data, optimizer, steps; experiments/config.py)
      and how results are read (config.compare); its method is replaced by each entry's.
    workdir: where results.json and the plots go.
    methods: labels to run (default: every label of the catalog).
    verbose: print progress and the table.
    catalog: label -> METHODS-style entry; default `METHODS`.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jaxcomm import comm  # pylint: disable=import-outside-toplevel

  check(config)
  for network in config.compare.networks:
    comm.preset(network)  # an unknown preset fails before anything trains
  catalog = METHODS if catalog is None else catalog
  labels = resolve_methods(methods, catalog)
  configs = {label: method_config(config, catalog[label]) for label in labels}
  results, inputs = [], []
  compiler = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  for label in labels:
    if verbose:
      print(f"training {label} ({config.steps} steps on {jax.device_count()} devices)...",
            file=sys.stderr, flush=True)
    start = time.perf_counter()
    record, sim_inputs = train_method(label, configs[label])
    if verbose:
      print(f"  {label}: loss {record['final_loss']:.4f} after "
            f"{time.perf_counter() - start:.1f} s (compiles included)", file=sys.stderr,
            flush=True)
    results.append(record)
    inputs.append(sim_inputs)
    sim_inputs["local_step"] = compiler.submit(compile_local_step, *sim_inputs["local_step"])
  if verbose:
    print("measuring compute per step...", file=sys.stderr, flush=True)
  compute = measure_compute({r["method"]: i["local_step"] for r, i in zip(results, inputs)},
                            config.compare.compute_repeats)
  compiler.shutdown()
  for record, sim_inputs in zip(results, inputs):
    simulate_method(record, sim_inputs["report"], sim_inputs["step_bytes"],
                    compute[record["method"]], config)
  target, target_source = pick_target(results, config)
  add_time_to_target(results, target, config)
  text = table(results, config, target)
  os.makedirs(workdir, exist_ok=True)
  plots = plot(results, config, target, workdir)
  summary = {"config": config.to_dict(), "target_loss": target,
             "target_source": target_source,
             "networks": {n: dataclasses.asdict(comm.preset(n))
                          for n in config.compare.networks},
             "methods": results, "table": text, "plots": plots}
  with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  if verbose:
    print(f"\n{len(labels)} methods, {config.steps} inner steps each, "
          f"{jax.device_count()} workers; LM d_model={config.model.d_model} "
          f"layers={config.model.num_layers} on {config.data.name}; target loss "
          f"{target:.4f} ({target_source})")
    print(text)
    print(f"wrote {os.path.join(workdir, 'results.json')} and {', '.join(plots)}")
  return summary


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  try:
    run(_CONFIG.value, _WORKDIR.value, _METHODS.value)
  except ValueError as e:  # a user's mistake: one line, no traceback
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
