r"""Trains a model with one communication method on a mesh of (emulated) devices.

  python -m experiments.train --config=experiments/configs/diloco.py \
      --config.method.sync_every=50 --config.steps=2000 --workdir=runs/diloco

The run is described by one config (experiments/config.py): a file of experiments/configs/
and `--config.<path>=<value>` overrides, typed. It is recorded whole in
--workdir/config.json; running again with the same --workdir resumes from the newest
readable checkpoint, exactly (with no --config the saved one is used; a different config is
refused, except a larger `steps`). A setting out of range ends the program before anything
compiles with one line naming it (exit status 1).

Writes `metrics.jsonl` and `summary.json` into --workdir and prints a summary: final loss,
wire bytes (means per step: every axis's, from the compiled step; and what the optimiser
counts, on the axes the label names), the ratio "DP bytes / bytes" against exact data
parallelism on the same mesh over the axes the method synchronises (its compiled step) in
the steady state (whole periods of its syncs), with this run's own in brackets, and, on
meshes with more axes, the compiled step's bytes per mesh axis.

Checkpoints go to --workdir/checkpoints every `config.checkpoint_every` steps and at the end
(the last `config.keep` are kept). Preemption: on SIGTERM (one process; on several, JAX's
preemption notice) the run finishes the step under way, saves a checkpoint of it and exits
with status `PREEMPTED` (143, the status of a process ended by SIGTERM); the same command
resumes from that step.

Multi-host: pass --coordinator=host:port --num_processes=N --process_id=i to every process
(or run under SLURM / Open MPI / a Cloud TPU pod, where JAX reads them from the
environment); --devices is then the number of emulated CPU devices of each process. On one
machine, `python -m experiments.launch_local --processes=2 -- <these flags>` starts them.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import ml_collections
from absl import flags

from . import _cli, _reference, build, elastic_run
from . import config as _config
from jaxcomm import comm, elastic, train

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "dp.py")
_CONFIG = _config.define_config_flag(
    _DEFAULT_CONFIG, "The run's config file (experiments/configs/*.py; default.py:NAME for "
    "any method); override fields with --config.<path>=<value>.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/train", "Where config, metrics, checkpoints "
                               "and the summary go.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices (CPU runs only).",
                                lower_bound=1)
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "host:port of process 0 for a multi-process run.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes of a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout", 100, "Seconds after which a silent process is declared dead and the "
    "others abort (multi-process runs; elastic runs: config.elastic.heartbeat_timeout_s).")
_FAULT = flags.DEFINE_list(
    "fault", [], "Faults of this process for tests (experiments/elastic_run.py): kill@T, "
    "stop@T, hang@T, partition=P+..|P+..@T.")
_PROGRESS = flags.DEFINE_string(
    "progress_file", None, "Elastic runs: where each committed step is written (launcher).")

def _faults() -> list:
  """This process's --fault list; none when the program's flags were not parsed (a test or a
  notebook calling `execute` in-process)."""
  return elastic_run.parse_faults(_FAULT.value if flags.FLAGS.is_parsed() else [])


PREEMPTED = 128 + 15  # exit status of a run stopped by SIGTERM after saving (143)


def run_config(workdir: str):
  """The config of this run: --config (with overrides), or the one saved in `workdir` when
  --config is not given and `workdir` holds a run."""
  saved = os.path.join(workdir, "config.json")
  if not flags.FLAGS["config"].present and os.path.exists(saved):
    with open(saved, encoding="utf-8") as f:
      return ml_collections.ConfigDict(json.load(f))
  return _CONFIG.value


def main(argv):
  del argv
  if _DEVICES.value:
    jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  workdir = _WORKDIR.value
  config = run_config(workdir)
  # First, before any computation: joins the other processes of a multi-process run.
  if elastic_mode(config):  # processes may die and rejoin (experiments/elastic_run.py)
    elastic.start_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                              heartbeat_timeout_s=config.elastic.heartbeat_timeout_s,
                              collective_timeout_s=config.elastic.collective_timeout_s)
  else:
    train.start_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                            heartbeat_timeout_s=_HEARTBEAT.value)
  status = execute(config, workdir)
  if status:
    sys.exit(status)


def execute(config, workdir: str) -> int:
  """Builds, trains (resuming from `workdir`) and summarises one run; returns the exit
  status: 0, or PREEMPTED when the run saved a checkpoint and stopped early."""
  try:
    run = build.build(config)
    record_config(workdir, config)
  except ValueError as e:  # a user's mistake: one line, no traceback, nothing written
    _cli.fail(e)
  if elastic_mode(config):
    run_elastic(run, workdir)
    return 0
  program, state = train_run(run, workdir)
  steps_done = int(state.step)
  if steps_done < run.steps:  # preempted: the checkpoint of this step is on disk
    print(f"preempted at step {steps_done} of {run.steps}: saved a checkpoint in "
          f"{workdir}/checkpoints; run the same command to resume.", file=sys.stderr)
    return PREEMPTED
  if jax.process_index() == 0:
    summarize(run, program, state, workdir)
  return 0


def elastic_mode(config) -> bool:
  """Whether config.elastic.enabled (a config saved before elastic settings existed: no)."""
  return bool(config.get("elastic") and config.elastic.enabled)


def run_elastic(run, workdir: str) -> None:
  """Trains `run` with `jaxcomm.elastic` (config.elastic.enabled)."""
  c = run.config
  if set(run.mesh.axis_names) != {"data"} or c.data.label_skew:
    raise ValueError("elastic runs train on one data axis: config.mesh 'data=N' only, no "
                     "config.data.label_skew.")
  elastic_run.run(lambda m: train.make_program(run.loss_fn, run.optimizer, m, run.params,
                                               batch_axes="data", has_aux=run.has_aux),
                  run.params, run.batches, c, steps=run.steps,
                  round_steps=elastic_run.round_steps(c.method),
                  workdir=workdir, faults=_faults(),
                  progress_file=_PROGRESS.value if flags.FLAGS.is_parsed() else None)


def train_run(run, workdir: str):
  """Trains `run` in `workdir` (resuming from its checkpoints); returns (program, state)."""
  c = run.config
  program = run.program()
  checkpointer = None
  if c.checkpoint_every:
    checkpointer = train.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      every=c.checkpoint_every, keep=c.keep)
  batches = elastic_run.with_faults(run.batches,  # launch_local --kill (--fault=kill@T)
                                    _faults())
  state, _ = train.fit(program, program.init(run.params), batches, run.steps,
                       workdir=workdir, log_every=c.log_every, checkpointer=checkpointer)
  if checkpointer is not None:
    checkpointer.close()
  return program, state


def summarize(run, program, state, workdir: str) -> dict:
  """Writes summary.json (the whole run's record, across resumptions) and prints it.

  Bytes are means per device per step. Counted: what the optimiser's transforms count where
  they send (the method, ZeRO-3's gathers, the mean inside a replica), over the mesh's axes
  but the model's own (tensor-parallel activations, sequence-parallel attention, pipeline
  sends, which only the compiled step shows). Every axis and by axis: the compiled step,
  its syncs charged as the counters count them. The ratio is against exact DP on the same
  mesh over the axes the method synchronises (experiments/_reference.py): in the steady
  state (a whole number of the periods with which its counted bytes repeat), with this
  run's own in brackets (which depends on where the run stopped in a period).
  """
  del program
  c = run.config
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    last = ([json.loads(line) for line in f if line.strip()] or [{}])[-1]
  steps_done = int(state.step)
  per_step = last.get("total_wire_bytes", 0) / max(steps_done, 1)
  axes = comm.axis_names(run.method_axes)
  devices = list(run.mesh.devices.flat)
  dp_bytes = _reference.dp_bytes(c, axes, devices)
  model_axes = [a for a in run.mesh.axis_names if a in build.MODEL_AXES]
  counted_axes = [a for a in run.mesh.axis_names if a not in build.MODEL_AXES]
  by_axis, period, own_steady, every_axis = None, 1, None, per_step
  only_method_axes = set(run.mesh.axis_names) <= set(axes)
  if c.method.name == "dp" and only_method_axes:
    own = own_steady = per_step  # every step sends the same, and every byte is counted
  else:  # read the method's axes out of its compiled step, planned past the run's steps
    step, _ = _reference.step_plan(c, devices, steps=_reference.horizon(c, steps_done))
    mine, steady, period = _reference.steady_state(step, steps_done)
    own = per_step if only_method_axes else _reference.axis_bytes(mine, axes)
    own_steady = None if steady is None else _reference.axis_bytes(steady, axes)
    if not only_method_axes:
      by_axis = {",".join(k) or "?": v for k, v in mine.bytes_per_axis().items()}
      every_axis = sum(by_axis.values())
  over = ",".join(axes)
  ratio = dp_bytes / own if own else None
  steady_ratio = dp_bytes / own_steady if own_steady else None
  summary = {
      "method": c.method.name, "model": c.model.name, "dataset": c.data.name,
      "mesh": dict(run.mesh.shape), "steps": steps_done, "workers": run.num_workers,
      "processes": jax.process_count(), "final_loss": last.get("loss"),
      "skipped_steps": last.get("skipped_steps", 0),
      "wire_bytes_per_step": per_step,              # counted, over counted_axes, per step
      "counted_axes": counted_axes,                 # the model's own (tensor...) are not
      "step_wire_bytes_per_step": every_axis,       # the compiled step, every axis, per step
      "method_axes": list(axes),
      "method_wire_bytes_per_step": own,            # over the method's axes, mean per step
      "dp_wire_bytes_per_step": dp_bytes,           # DP on this mesh, same axes, per step
      "compression_ratio": ratio,                   # this run's; None: nothing sent
      # Over whole periods of the counted bytes (None: they do not repeat within the plan).
      "steady_state": None if own_steady is None else {
          "period_steps": period, "method_wire_bytes_per_step": own_steady,
          "compression_ratio": steady_ratio},
  }
  if by_axis is not None:
    summary["step_wire_bytes_by_axis"] = by_axis  # compiled step, mean per step
  with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  print(f"{c.method.name} on {c.model.name}/{c.data.name}, mesh {summary['mesh']}, "
        f"{run.num_workers} workers in {jax.process_count()} process(es), {steps_done} steps")
  lines = []
  if summary["final_loss"] is not None:
    lines.append(("final loss", f"{summary['final_loss']:.4f}"))
  if by_axis is None:
    lines.append(("wire bytes, mean per step", f"{per_step:,.0f} (counted, every axis: "
                                                f"{', '.join(counted_axes)})"))
  else:
    lines.append(("wire bytes, mean per step", f"{every_axis:,.0f} (compiled step, every "
                                                "axis)"))
    lines.append(("counted by the optimiser", f"{per_step:,.0f} (over "
                  f"{', '.join(counted_axes)}" + (f"; not the model's own on "
                                                  f"{', '.join(model_axes)})" if model_axes
                                                  else ")")))
    lines.append((f"over {over}, mean per step", f"{own:,.0f}"))
    lines.append(("compiled step by axis, mean per step",
                  ", ".join(f"{k} {v:,.0f}" for k, v in by_axis.items())))
  lines.append((f"exact DP over {over}, this mesh", f"{dp_bytes:,.0f} per step"))
  lines.append((f"DP bytes / bytes (over {over})", _ratio_text(ratio, steady_ratio, period,
                                                               steps_done, over)))
  width = max(len(k) for k, _ in lines)
  for k, value in lines:
    print(f"  {k.ljust(width)}  {value}")
  return summary


def _ratio_text(ratio, steady, period, steps: int, over: str) -> str:
  """The steady-state ratio with this run's own in brackets; never `inf`."""
  run = (f"{ratio:.2f}x" if ratio is not None else f"nothing sent over {over}")
  if steady is None:
    return (f"{ratio:.2f}x over" if ratio is not None else f"nothing sent over {over} in") + \
        f" this run's {steps} steps (no steady state: the counted bytes do not repeat " \
        "within the plan)"
  if period == 1 and ratio is not None and abs(steady - ratio) <= 1e-9 * steady:
    return f"{steady:.2f}x (every step sends the same)"
  return (f"{steady:.2f}x steady state, whole periods of {period} step{'s' * (period > 1)} "
          f"(this run's {steps} steps: {run})")


def record_config(workdir: str, config) -> None:
  """Writes `config` to workdir/config.json, or refuses a workdir that holds a run with other
  settings (every setting counts except `steps`, which a resumed run may extend)."""
  settings = json.loads(json.dumps(_config.to_dict(config)))  # as it reads back from disk
  path = os.path.join(workdir, "config.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    changed = _config.differences(saved, settings, ignore=("steps",))
    if changed:
      raise ValueError(f"--workdir {workdir} holds a run with other settings "
                       f"{{setting: (saved, now)}}: {changed}; use another --workdir.")
  elif jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      json.dump(settings, f, indent=2)
    os.replace(path + ".tmp", path)  # the other processes read it whole or not at all


if __name__ == "__main__":
  _cli.run(main)
