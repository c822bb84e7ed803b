"""What every paper reproduction (`experiments/reproduce/*.py`) shares.

* its settings: one config per reproduction, experiments/configs/reproduce/<name>.py
  (`get_config()`: `base_config()`, experiments/config.py's tree at the reproductions'
  sizes, with what the reproduction changes and its own settings under `reproduce`), read
  with `--config.<path>=<value>` overrides (`define_flags`, `start`), so that a setting
  means the same thing in every reproduction and in experiments/train.py;
* `train_run`: one method for N steps on W emulated workers, built through
  `experiments/build.py` and `jaxcomm.train`, returning its loss curve, the wire bytes
  counted at every step (mean, peak) and its loss (and accuracy) on a held-out split the
  training batches never touch; with `warm_start_steps` every run starts from the same
  parameters, pretrained by exact DP (`warm_start`), and continues with the batches after
  the pretraining's;
* `write_results`: `results.md` (the markdown table), `results.json` (every number) and the
  figures into the workdir.

Numbers in the tables are read from these records; nothing is typed in.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
from absl import flags

from .. import _cli, build
from .. import config as _config
from .. import toolkit
from jaxcomm import comm, data, sim, train

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                       "reproduce")
# What a run reads from config.reproduce; the rest of that section is the program's own
# settings (its sweeps), which no single run depends on: a run two programs share (DP at
# the same sizes) has one config and trains once per process.
RUN_SETTINGS = ("eval_batch", "smooth", "warm_start_steps", "warm_start_batch",
                "method_settings")
METHOD_OVERRIDES = (" --config.method.<setting> sets a setting of the methods the "
                    "reproduction runs (not one it sweeps) in each run of a method that has "
                    "it.")
# The shared settings `--help` lists beside the program's own (any path of the tree works).
LISTED = ("steps", "seed", "model.d_model", "model.num_layers", "data.seq_len",
          "data.batch_size", "optimizer.name", "optimizer.lr")


def base_config(**reproduce):
  """What every method of a reproduction shares (experiments/config.py's tree): 150 steps on
  the train split (the held-out split is the eval's), no checkpoints, the LM's MLP 4x its
  width (`model.d_ff` follows an override of `model.d_model`), and under `reproduce`:
  held-out LM sequences (`eval_batch`; digits uses its whole held-out split), the steps in
  the trailing mean reported as the final train loss (`smooth`), and the steps of exact DP
  every run starts from (`warm_start_steps`, at `warm_start_batch`, the base batch, on
  `WARM_START_WORKERS`; 0: from the initialisation), then `reproduce`'s items (the
  program's own settings)."""
  c = _config.base_config("dp")
  c.steps, c.checkpoint_every = 150, 0
  c.data.split = "train"
  c.model.d_ff = c.model.get_ref("d_model") * 4
  c.reproduce = ml_collections.ConfigDict(dict(
      eval_batch=256, smooth=10, warm_start_steps=0,
      warm_start_batch=c.data.get_ref("batch_size")))
  c.reproduce.update(reproduce)
  return c


def check(c) -> None:
  """The shared settings of a reproduction's config (ValueError naming the first out of
  range); each program checks its own (`config.values_at_least`, ...)."""
  for path, low in (("eval_batch", 1), ("smooth", 1), ("warm_start_steps", 0),
                    ("warm_start_batch", 1)):
    toolkit.int_at_least(c, f"reproduce.{path}", low)
  _config.check(c)


def load(name: str):
  """experiments/configs/reproduce/<name>.py's config (references resolved)."""
  module = importlib.import_module(f"..configs.reproduce.{name}", __package__)
  return module.get_config().copy_and_resolve_references()


def define_flags(name: str, flag_values=None, methods: tuple = ()):
  """`--config` (experiments/configs/reproduce/<name>.py; `--help` lists its settings),
  `--workdir` (default runs/reproduce_<name>) and `--devices`, as train.py takes them;
  returns the config's flag holder; `--config.method.<setting>` takes the settings of
  `methods` (the methods the program runs). Defined only when a program runs (under `if
  __name__ == "__main__"`), so that importing the reproductions in tests registers nothing
  that could clash with another program's flags."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  c = load(name)
  value = lambda path: functools.reduce(lambda tree, key: tree[key], path.split("."), c)
  shared = ", ".join(f"{path}={value(path)}" for path in LISTED)
  holder = _cli.config_flag(
      os.path.join(CONFIGS, f"{name}.py"),
      f"The reproduction's config (experiments/configs/reproduce/{name}.py): experiments/"
      f"config.py's tree, the program's own settings under `reproduce`. Settings: {shared}, "
      f"{_cli.settings(c.reproduce, 'reproduce.')}.",
      flag_values, overrides=_cli.SETTING_OVERRIDES + METHOD_OVERRIDES, several=tuple(methods))
  flags.DEFINE_string("workdir", f"runs/reproduce_{name}", "Where results.md, results.json and the "
                      "figure go.", flag_values=flag_values)
  flags.DEFINE_integer("devices", 8, "Emulated CPU devices.", lower_bound=1,
                       flag_values=flag_values)
  return holder


def main(name: str, run: Callable[[ml_collections.ConfigDict, str], Any],
         methods: tuple = ()) -> None:
  """The program `python -m experiments.reproduce.<name>`: its command line
  (`define_flags`), then `run(config, workdir)` (`start`) through `_cli.run`."""
  def program(argv):
    del argv
    run(*start())  # its summary is in the workdir; app.run would exit with it as a status

  define_flags(name, methods=methods)
  _cli.run(program)


def start() -> tuple[ml_collections.ConfigDict, str]:
  """(the command line's config, checked, its references resolved; --workdir), with the
  emulated devices (--devices) set before JAX starts a backend."""
  jax.config.update("jax_num_cpu_devices", flags.FLAGS.devices)
  c = flags.FLAGS.config.copy_and_resolve_references()
  given = _cli.method_settings(c)
  if given:  # each run takes those its method has (`config`)
    c.reproduce.method_settings = ml_collections.ConfigDict(given)
  check(c)
  return c, flags.FLAGS.workdir


def config(base, method: str, *, lr: float | None = None, batch_size: int | None = None,
           **settings):
  """One run of `base` (its model, data and optimizer): `method` with the method settings
  the command line gave (`reproduce.method_settings`, those the method has), then its
  `settings` (what the reproduction sweeps), and the run's own learning rate and global
  batch where given. The program's own settings are left out of `reproduce` (see
  RUN_SETTINGS)."""
  c = base.copy_and_resolve_references()
  given = dict(c.reproduce.get("method_settings") or {})
  own = build.method_defaults(method).keys()
  settings = {**{k: v for k, v in given.items() if k in own}, **settings}
  with c.unlocked():
    c.reproduce = ml_collections.ConfigDict({k: c.reproduce[k] for k in RUN_SETTINGS
                                             if k in c.reproduce})
  if lr is not None:
    c.optimizer.lr = lr
  if batch_size is not None:
    c.data.batch_size = batch_size
  return _config.with_method(c, {"method": method, **settings})


def heldout_batch(c):
  """The held-out batch: LM sequences from the test split, or digits' whole test split."""
  test = data.load(c.data.name).split()[1]
  if c.model.name == "lm":
    return test.batch(0, c.reproduce.eval_batch, seq_len=c.data.seq_len, seed=c.seed + 1)
  return test.all()


def mesh_devices(workers: int) -> list:
  """The first `workers` devices."""
  return jax.devices()[:workers]


def mesh_of(workers: int):
  """A {"data": workers} mesh on the first `workers` devices."""
  return train.make_mesh({"data": workers}, devices=mesh_devices(workers))


def evaluate(loss_fn, has_aux: bool, params, held_out) -> dict:
  """Held-out loss (and accuracy for classifiers) of `params` on one device."""
  out = jax.jit(loss_fn)(params, held_out)
  if has_aux:
    loss, aux = out
    return {"heldout_loss": float(loss), "heldout_accuracy": float(aux["accuracy"])}
  return {"heldout_loss": float(out)}


# (config, workers) -> record: a run two sweeps share (DP as every reference, the 8-worker
# DiLoCo of both DiLoCo sweeps) trains once per process. Runs are deterministic.
_DONE: dict[str, dict] = {}
# (config, workers) -> its final parameters (the mean over workers), for warm starts.
_PARAMS: dict[str, Any] = {}
WARM_START_WORKERS = 8  # the pretraining every warm-started run starts from


def train_run(label: str, c, workers: int = 8, **info) -> dict:
  """Trains config `c` (through experiments.build) for c.steps on `workers` workers.

  Returns a record: the loss and wire bytes of every step, their summaries (final smoothed
  train loss, mean and peak bytes per step, exact DP's all-reduce bytes for the same
  parameters, the bytes of the compiled step's collectives read by `comm.inspect`), and the
  held-out metrics of the parameters averaged over workers (the parameters themselves where
  they are replicated; DiLoCo's workers all hold θ_out right after a sync). `info` is copied
  into the record (the swept setting, e.g. H). A run already made in this process with the
  same config and workers is not repeated.
  """
  key = c.to_json() + f"/{workers}"
  if key not in _DONE:
    _DONE[key], _PARAMS[key] = _train(c, workers, label)
  return {**_DONE[key], "label": label, **info}


def warm_start_config(c):
  """The run every run of `c` starts from: c.reproduce.warm_start_steps of exact DP at the
  base batch (`warm_start_batch`) on WARM_START_WORKERS workers, from the initialisation;
  None when `c` starts from the initialisation."""
  if not c.reproduce.warm_start_steps:
    return None
  w = _config.with_method(c, {"method": "dp"})  # a copy
  w.steps = c.reproduce.warm_start_steps
  w.data.batch_size = c.reproduce.warm_start_batch
  w.reproduce.warm_start_steps = 0
  return w


def warm_start(c) -> tuple[dict | None, Any, int]:
  """(the pretraining's record, its parameters, its steps) for `c`; (None, None, 0) when `c`
  starts from the initialisation. The pretraining trains once per process."""
  w = warm_start_config(c)
  if w is None:
    return None, None, 0
  record = train_run(f"DP warm start ({w.steps} steps)", w, WARM_START_WORKERS)
  return record, _PARAMS[w.to_json() + f"/{WARM_START_WORKERS}"], w.steps


def _train(c, workers: int, label: str) -> tuple[dict, Any]:
  _, warm_params, offset = warm_start(c)  # the pretraining trains first, if not yet done
  print(f"training {label} ({c.steps} steps, {workers} workers"
        f"{', from the DP warm start' if offset else ''})...", file=sys.stderr, flush=True)
  c = c.copy_and_resolve_references()
  c.mesh = f"data={workers}"
  run = build.build(c, devices=mesh_devices(workers))
  trainer = run.trainer()
  state = trainer.init(run.params if warm_params is None else warm_params)
  start = time.perf_counter()
  # After a warm start, the batches after the pretraining's.
  state, history = train.fit(trainer, state, lambda t: run.batches(offset + t), run.steps,
                             log_every=1, progress=False)
  seconds = time.perf_counter() - start
  # The collectives of the step program (already compiled by the run: no second compile);
  # branches that run only on some steps (a DiLoCo sync) are in `compiled_branch_bytes`.
  batch = trainer.shard_batch(run.batches(0))  # as fit passes it: the program is reused
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  per_worker = trainer.layout.params
  final = jax.tree.map(lambda pw, x: np.asarray(x).mean(0) if pw else np.asarray(x),
                       per_worker, state.params)
  losses = np.array([row["loss"] for row in history])
  step_bytes = np.array([row["wire_bytes"] for row in history], dtype=np.float64)
  record = {
      "method": c.method.to_dict(), "optimizer": c.optimizer.name, "lr": c.optimizer.lr,
      "workers": workers, "steps": run.steps, "batch_size": c.data.batch_size,
      "warm_start_steps": offset,
      "final_train_loss": float(sim.smooth(losses, c.reproduce.smooth)[-1]),
      "bytes_per_step": float(step_bytes.mean()),
      "peak_bytes_per_step": float(step_bytes.max()),
      "total_bytes": float(step_bytes.sum()),
      "compiled_step_bytes": float(report.wire_bytes(conditional=False)),
      "compiled_branch_bytes": float(report.wire_bytes(conditional=True)),
      "dp_bytes_per_step": float(comm.allreduce_bytes(comm.tree_bytes(run.params), workers)),
      "train_seconds": seconds,
      "curve": {"loss": losses.tolist(), "wire_bytes": step_bytes.tolist()},
      **evaluate(run.model_loss_fn, run.has_aux, final, heldout_batch(c)),
  }
  return record, final


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub markdown table: floats with 4 decimals, from 1,000 up as whole numbers."""
  def cell(x):
    if isinstance(x, int) and not isinstance(x, bool):
      return f"{x:,}"
    if isinstance(x, float):
      return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4f}"
    return str(x)
  lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
  lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
  return "\n".join(lines)


def method_table(records: Sequence[dict], reference: dict, smooth: int, *,
                 accuracy: bool = False, peak: bool = False) -> str:
  """One row per record: losses (and held-out accuracy), bytes per step (and the peak of a
  single step), and `reference`'s bytes per step divided by the record's."""
  headers = ["method", f"train loss (mean of last {smooth})", "held-out loss"]
  headers += ["held-out accuracy"] * accuracy + ["bytes/step/device"]
  headers += ["peak bytes in one step"] * peak + [f"{reference['label']} bytes / bytes"]
  rows = []
  for r in records:
    ratio = reference["bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else "inf"
    rows.append([r["label"], r["final_train_loss"], r["heldout_loss"]]
                + [r.get("heldout_accuracy")] * accuracy + [r["bytes_per_step"]]
                + [r["peak_bytes_per_step"]] * peak + [ratio])
  return markdown_table(headers, rows)


def save_figure(path: str, panels: Sequence[dict]) -> str:
  """One row of panels; each panel: title, xlabel, ylabel, lines [(label, x, y)], and
  optionally logx / logy. Every panel gets labelled axes and a legend."""
  import matplotlib  # lazy: heavy, and only plots need it
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
  for ax, panel in zip(axes[0], panels):
    for label, x, y in panel["lines"]:
      ax.plot(x, y, marker="o" if len(x) <= 12 else None, label=label)
    if panel.get("logx"):
      ax.set_xscale("log")
      ticks = sorted({float(x) for _, xs, _ in panel["lines"] for x in xs})
      if len(ticks) <= 12:  # label the swept values themselves, not powers of ten
        ax.set_xticks(ticks, [_short(t) for t in ticks])
        ax.minorticks_off()
    if panel.get("logy"):
      ax.set_yscale("log")
    ax.set_title(panel["title"])
    ax.set_xlabel(panel["xlabel"])
    ax.set_ylabel(panel["ylabel"])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def _short(x: float) -> str:
  """A tick label: 75040 -> '75k', 2401280 -> '2.4M', 25 -> '25'."""
  for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= size:
      return f"{x / size:.3g}{suffix}"
  return f"{x:g}"


def curve_lines(records: Sequence[dict], smooth: int) -> list:
  """(label, step, smoothed train loss) of each record, for save_figure."""
  return [(r["label"], np.arange(1, len(r["curve"]["loss"]) + 1),
           sim.smooth(r["curve"]["loss"], smooth)) for r in records]


def write_results(workdir: str, title: str, sections: Sequence[tuple[str, str]],
                  base, summary: dict) -> dict:
  """Writes results.md (title, then each (heading, markdown table)) and results.json
  (the scale, summary and the markdown), prints the markdown, returns the summary."""
  os.makedirs(workdir, exist_ok=True)
  text = f"# {title}\n\n" + "\n\n".join(f"## {head}\n\n{table}" for head, table in sections)
  summary = {"config": base.to_dict(), **summary, "markdown": text}
  with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  print(text)
  print(f"\nwrote {workdir}/results.md, results.json and {', '.join(summary.get('figures', []))}")
  return summary
