r"""Compares communication methods on the LM: loss, wire bytes and simulated time on networks.

  python -m experiments.compare --workdir=runs/compare          # default: minutes
  python -m experiments.compare --long --workdir=runs/compare   # longer, larger, more faithful

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

The target loss (unless --target_loss is given) is the smoothed loss exact data parallelism
reaches at --target_fraction of its steps, so that DP reaches it by construction and every
other method is timed to the same quality. A target a method never reaches is reported as
"not reached", never as a time.

Methods come from experiments/builders.py's registry (`METHODS` below lists the variants:
exact DP in float32 and bfloat16, PowerSGD, top-k, int8 and QSGD with error feedback, DeMo,
DiLoCo, Streaming DiLoCo and ACCO); those whose builder is not registered on this checkout
are skipped with a note. Overlapping schedules (Streaming DiLoCo, ACCO) hide communication
behind later steps' compute on the simulated clock (`sim.overlap_steps`); results.json also
gives each run's time with nothing hidden (`total_seconds_without_overlap`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np
from absl import app
from absl import flags

# label -> (registered algo, Config overrides). Only labels whose algo is registered run.
# A Config built here gets `extra` only from what is written below (not from train.py's flag
# defaults), so every entry names each setting its builder reads (experiments/algos_*.py).
# Local-update methods sync every H = 10 of the default 150 inner steps (15 syncs); a
# schedule that overlaps communication with compute gets its overlap on the simulated
# clock from `sim.overlap_steps(algo, tau=extra["overlap"])` (`overlap_tau`).
_NO_PARTICIPATION = {"participation": None}  # every worker takes part in every sync
METHODS: dict[str, tuple[str, dict]] = {
    "dp": ("dp", {}),
    "dp_bf16": ("dp", {"reduce_dtype": "bfloat16"}),
    # PowerSGD rank 4 with error feedback, from the first step (arXiv 1905.13727).
    "powersgd_r4": ("powersgd", {"extra": {"rank": 4, "memory": "ef", "start_iter": 0}}),
    # Top-k 1% with error feedback: (index, value) pairs all-gathered.
    "topk1%_ef": ("compressed", {"extra": {"codec": "top_k", "fraction": 0.01, "bits": 4,
                                           "chunk": None, "memory": "ef",
                                           "collective": "auto"}}),
    # int8 (per-block scales) with error feedback, through the two-phase all-reduce.
    "int8_ef": ("compressed", {"extra": {"codec": "uniform", "bits": 8, "fraction": 0.01,
                                         "chunk": None, "memory": "ef",
                                         "collective": "two_phase"}}),
    # QSGD, 4-bit codes (s = 7 levels and a sign) with a norm per 64-element bucket, with
    # error feedback, two-phase.
    "qsgd4_ef": ("compressed", {"extra": {"codec": "qsgd", "bits": 4, "fraction": 0.01,
                                          "chunk": 64, "memory": "ef",
                                          "collective": "two_phase"}}),
    # DeMo (arXiv 2411.19870) as in the paper: k = 32 of every tile of up to 64 x 64 DCT
    # coefficients; a sign update, so a smaller lr than AdamW's.
    "demo": ("demo", {"lr": 1e-3, "extra": {"beta": 0.999, "chunk": 64, "k": 32}}),
    # DiLoCo (arXiv 2311.08105): inner AdamW, outer Nesterov SGD lr 0.7 momentum 0.9.
    "diloco_h10": ("diloco", {"extra": {"sync_every": 10, "outer_lr": 0.7,
                                        "outer_momentum": 0.9, "outer_codec": None,
                                        "outer_memory": False, **_NO_PARTICIPATION}}),
    # Streaming DiLoCo (arXiv 2501.18512): 2 fragments, fp4 outer gradients, each merged
    # tau = 2 inner steps after it is sent (the sync overlaps those steps).
    "streaming_h10": ("streaming_diloco", {"extra": {
        "sync_every": 10, "fragments": 2, "overlap": 2, "merge_alpha": 0.5,
        "outer_codec": "auto", "outer_lr": 0.7, "outer_momentum": 0.9,
        **_NO_PARTICIPATION}}),
    # ACCO (arXiv 2406.02613): one micro-batch per round; a round's reduce-scatter and
    # all-gather overlap the next round's gradient.
    "acco": ("acco", {"extra": {"micro_batches": 1}}),
}


def overlap_tau(overrides: dict) -> int | None:
  """Streaming DiLoCo's tau: its builder's `overlap` setting (None for other methods)."""
  return overrides.get("extra", {}).get("overlap")


_WORKDIR = flags.DEFINE_string("workdir", "runs/compare", "Where results and plots go.")
_METHODS = flags.DEFINE_list("methods", None, "Method labels to compare (default: all "
                             "registered ones in METHODS).")
_LONG = flags.DEFINE_bool("long", False, "A longer run of a larger model and longer "
                          "sequences (about 5 CPU-minutes per method).")
_STEPS = flags.DEFINE_integer("steps", None, "Inner steps per method (default 150; 1000 "
                              "with --long).")
_TARGET = flags.DEFINE_float("target_loss", None, "Loss to time (default: from the DP run).")
_TARGET_FRACTION = flags.DEFINE_float("target_fraction", 0.8, "Default target: DP's smoothed "
                                      "loss at this fraction of its steps.")
_NETWORKS = flags.DEFINE_list("networks", ["wan", "infiniband"], "Link presets to simulate "
                              "(comm.PRESETS): a WAN and a datacenter one.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of parameters and batches.")


@dataclasses.dataclass(frozen=True)
class Settings:
  """What every method shares (the model, data, steps) and how results are read."""
  steps: int = 150
  batch_size: int = 32
  seq_len: int = 64
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  d_ff: int = 256
  lr: float = 3e-3
  seed: int = 0
  smooth: int = 10            # records in the trailing mean of the loss curve
  target_loss: float | None = None
  target_fraction: float = 0.8
  networks: tuple = ("wan", "infiniband")
  compute_repeats: int = 10

  def __post_init__(self):
    for name in ("steps", "batch_size", "seq_len", "d_model", "num_layers", "num_heads",
                 "d_ff", "smooth", "compute_repeats"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if not 0 < self.target_fraction <= 1:
      raise ValueError(f"target_fraction must be in (0, 1], got {self.target_fraction}.")
    if self.target_loss is not None and not math.isfinite(self.target_loss):
      raise ValueError(f"target_loss must be finite, got {self.target_loss}.")


# --long: ~0.3 CPU-seconds per step on 8 emulated devices (measured), ~5 CPU-minutes per
# method; the default is ~0.065 CPU-seconds per step, ~10 s of steps per method plus compiles.
LONG = dict(steps=1000, d_model=96, num_layers=3, d_ff=384, batch_size=32, seq_len=128)


def _config(settings: Settings, algo: str, overrides: dict, axis_name: Any):
  from experiments import builders  # pylint: disable=import-outside-toplevel
  fields = dict(
      model="lm", dataset="pydoc", algo=algo, optimizer="adamw", lr=settings.lr,
      steps=settings.steps, batch_size=settings.batch_size, seq_len=settings.seq_len,
      seed=settings.seed, axis_name=axis_name, d_model=settings.d_model,
      num_layers=settings.num_layers, num_heads=settings.num_heads, d_ff=settings.d_ff)
  fields.update(overrides)  # a method's own settings win (e.g. DeMo's lr)
  return builders.Config(**fields)


def resolve_methods(labels: list | None, catalog: dict | None = None) -> tuple[list, list]:
  """(labels to run, notes on skipped ones); unknown labels are an error.

  `catalog` maps labels to (algo, Config overrides) like `METHODS` (the default)."""
  from experiments import builders  # pylint: disable=import-outside-toplevel
  catalog = METHODS if catalog is None else catalog
  labels = list(catalog) if labels is None else list(labels)
  unknown = [l for l in labels if l not in catalog]
  if unknown:
    raise ValueError(f"methods {unknown} are unknown; allowed: {', '.join(catalog)}.")
  run, notes = [], []
  for label in labels:
    algo = catalog[label][0]
    if algo in builders.ALGORITHMS:
      run.append(label)
    else:
      notes.append(f"{label}: skipped, algo {algo!r} is not registered on this checkout.")
  if not run:
    raise ValueError(f"none of the methods {labels} is registered on this checkout.")
  return run, notes


def _local_step(settings: Settings, algo: str, overrides: dict, loss_fn, params, batch):
  """One worker's step (gradient, transform, update) with no communication: the method
  built for one device (axis_name=None), as a jitted function and its arguments."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from experiments import builders  # pylint: disable=import-outside-toplevel

  cfg = _config(settings, algo, overrides, None)
  tx = builders.make_optimizer(cfg)
  loss_fn = builders.task_loss(cfg, loss_fn)

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


def train_method(label: str, algo: str, overrides: dict, settings: Settings,
                 mesh) -> tuple[dict, dict]:
  """Trains one method; returns its record and what the simulation needs."""
  from experiments import builders  # pylint: disable=import-outside-toplevel
  from jaxcomm import comm, sim, train  # pylint: disable=import-outside-toplevel

  cfg = _config(settings, algo, overrides, "data")
  _, loss_fn, params, batch_fn, has_aux = builders.make_task(cfg)
  trainer = train.Trainer(builders.task_loss(cfg, loss_fn), builders.make_optimizer(cfg), mesh,
                          axis_name="data", has_aux=has_aux)
  state = trainer.init(params)
  batch0 = trainer.shard_batch(batch_fn(0))
  report = comm.inspect(trainer.step_fn(state, batch0), state, batch0)
  start = time.perf_counter()
  state, history = train.fit(trainer, state, batch_fn, settings.steps, log_every=1,
                             progress=False)
  train_seconds = time.perf_counter() - start
  losses = np.array([row["loss"] for row in history])
  step_bytes = np.array([row["wire_bytes"] for row in history], dtype=np.float64)
  workers = trainer.num_workers
  local = {k: v[:settings.batch_size // workers] for k, v in batch_fn(0).items()}
  dp_bytes = comm.allreduce_bytes(comm.tree_bytes(params), workers)
  per_step = float(step_bytes.mean())
  smoothed = sim.smooth(losses, settings.smooth)
  record = {
      "method": label, "algo": algo, "overrides": overrides, "workers": workers,
      "steps": settings.steps, "final_loss": float(smoothed[-1]),
      "wire_bytes_per_step": per_step, "dp_wire_bytes_per_step": dp_bytes,
      "compression_ratio": dp_bytes / per_step if per_step else None,
      "inspected_wire_bytes": {"every_step": report.wire_bytes(conditional=False),
                               "conditional": report.wire_bytes(conditional=True)},
      "overlap_steps": sim.overlap_steps(algo, tau=overlap_tau(overrides)),
      "train_seconds_emulated": train_seconds,
      "curve": {"step": [row["step"] for row in history], "loss": losses.tolist(),
                "smoothed_loss": smoothed.tolist(),
                "cumulative_wire_bytes": np.cumsum(step_bytes).tolist()},
      "networks": {},
  }
  sim_inputs = {"report": report, "step_bytes": step_bytes,
                "local_step": _local_step(settings, algo, overrides, loss_fn, params, local)}
  return record, sim_inputs


def simulate_method(record: dict, report, step_bytes, compute: float,
                    settings: Settings) -> None:
  """Puts a trained method on the simulated clock of every network (fills record)."""
  from jaxcomm import comm, sim  # pylint: disable=import-outside-toplevel
  record["compute_seconds_per_step"] = compute
  for network in settings.networks:
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


def pick_target(results: list, settings: Settings) -> tuple[float, str]:
  if settings.target_loss is not None:
    return float(settings.target_loss), "given by --target_loss"
  ref = next((r for r in results if r["method"] == "dp"), results[0])
  idx = max(int(math.ceil(settings.target_fraction * len(ref["curve"]["loss"]))) - 1, 0)
  return (float(ref["curve"]["smoothed_loss"][idx]),
          f"{ref['method']}'s smoothed loss at step {idx + 1} of {len(ref['curve']['loss'])}")


def add_time_to_target(results: list, target: float, settings: Settings) -> None:
  from jaxcomm import sim  # pylint: disable=import-outside-toplevel
  for r in results:
    for net in r["networks"].values():
      net["time_to_target"] = sim.time_to_target(r["curve"]["loss"], net["time"], target,
                                                 window=settings.smooth)


def _fmt_time(seconds: float | None) -> str:
  if seconds is None:
    return "not reached"
  return f"{seconds:,.1f} s" if seconds >= 1 else f"{seconds * 1e3:,.1f} ms"


def table(results: list, settings: Settings, target: float) -> str:
  """One row per method: final loss, bytes, ratio, and per network the simulated time to
  the target loss and of the whole run (every method runs the same number of steps)."""
  nets = list(settings.networks)
  steps = results[0]["steps"] if results else settings.steps
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


def plot(results: list, settings: Settings, target: float, workdir: str) -> list:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  paths = []
  nets = list(settings.networks)
  fig, axes = plt.subplots(1, len(nets), figsize=(5.5 * len(nets) + 1.8, 4.5), squeeze=False)
  for ax, network in zip(axes[0], nets):
    for i, r in enumerate(results):
      ax.plot(r["networks"][network]["time"], r["curve"]["smoothed_loss"], **_style(i, r))
    ax.set_xscale("log")
    ax.set_xlabel(f"simulated wall clock on '{network}' (s, log scale)")
    ax.set_ylabel(f"training loss (mean of last {settings.smooth} steps)")
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
  ax.set_ylabel(f"training loss (mean of last {settings.smooth} steps)")
  ax.set_title("loss vs communication")
  ax.grid(True, alpha=0.3)
  _finish(fig, ax, target)
  fig.tight_layout(rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1))
  paths.append(os.path.join(workdir, "loss_vs_bytes.png"))
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def run(settings: Settings, workdir: str, methods: list | None = None, *,
        verbose: bool = True, catalog: dict | None = None) -> dict:
  """Runs the comparison, prints the table and writes results.json and the plots.

  Args:
    settings: what every method shares.
    workdir: where results.json and the plots go.
    methods: labels to run (default: every registered one of the catalog).
    verbose: print progress, the table and notes.
    catalog: label -> (algo, Config overrides); default `METHODS`.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jaxcomm import comm, train  # pylint: disable=import-outside-toplevel

  for network in settings.networks:
    comm.preset(network)  # an unknown preset fails before anything trains
  catalog = METHODS if catalog is None else catalog
  labels, notes = resolve_methods(methods, catalog)
  mesh = train.make_mesh({"data": jax.device_count()})
  results, inputs = [], []
  compiler = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  for label in labels:
    if verbose:
      print(f"training {label} ({settings.steps} steps on {jax.device_count()} devices)...",
            file=sys.stderr, flush=True)
    start = time.perf_counter()
    record, sim_inputs = train_method(label, *catalog[label], settings, mesh)
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
                            settings.compute_repeats)
  compiler.shutdown()
  for record, sim_inputs in zip(results, inputs):
    simulate_method(record, sim_inputs["report"], sim_inputs["step_bytes"],
                    compute[record["method"]], settings)
  target, target_source = pick_target(results, settings)
  add_time_to_target(results, target, settings)
  text = table(results, settings, target)
  os.makedirs(workdir, exist_ok=True)
  plots = plot(results, settings, target, workdir)
  summary = {"settings": dataclasses.asdict(settings), "target_loss": target,
             "target_source": target_source,
             "networks": {n: dataclasses.asdict(comm.preset(n)) for n in settings.networks},
             "methods": results, "notes": notes, "table": text, "plots": plots}
  with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  if verbose:
    print(f"\n{len(labels)} methods, {settings.steps} inner steps each, "
          f"{jax.device_count()} workers; LM d_model={settings.d_model} "
          f"layers={settings.num_layers} on pydoc; target loss {target:.4f} ({target_source})")
    print(text)
    for note in notes:
      print(note)
    print(f"wrote {os.path.join(workdir, 'results.json')} and {', '.join(plots)}")
  return summary


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  base = dict(LONG) if _LONG.value else {}
  if _STEPS.value is not None:
    base["steps"] = _STEPS.value
  settings = Settings(seed=_SEED.value, target_loss=_TARGET.value,
                      target_fraction=_TARGET_FRACTION.value,
                      networks=tuple(_NETWORKS.value), **base)
  run(settings, _WORKDIR.value, _METHODS.value)


if __name__ == "__main__":
  app.run(main)
