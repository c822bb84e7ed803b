r"""Trains a model with one communication method on a mesh of (emulated) devices.

  python -m experiments.train --model=lm --algo=dp --steps=200 --workdir=runs/dp

Writes `metrics.jsonl` and `summary.json` into --workdir and prints a summary: final loss,
wire bytes per step, and the compression ratio against exact data parallelism.

Checkpoints go to --workdir/checkpoints every --checkpoint_every steps and at the end (the
last --keep are kept); running the same command again resumes from the newest readable one,
exactly (a different configuration in the same --workdir is refused).

Preemption: on SIGTERM (one process; on several, JAX's preemption notice) the run finishes
the step under way, saves a checkpoint of it, and exits with status `PREEMPTED` (143, the
status of a process ended by SIGTERM, so schedulers see it was stopped, not finished);
running the same command again resumes from that step.

Multi-host: pass --coordinator=host:port --num_processes=N --process_id=i to every process
(or run under SLURM / Open MPI / a Cloud TPU pod, where JAX reads them from the environment);
--devices is then the number of emulated CPU devices of each process. On one machine,
`python -m experiments.launch_local --processes=2 -- <these flags>` starts the processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
from absl import app
from absl import flags

_MODEL = flags.DEFINE_enum("model", "lm", ["lm", "mlp"], "Model to train.")
_DATASET = flags.DEFINE_string("dataset", None,
                               "digits | pydoc | stdlib | text:<path> (default by model).")
_ALGO = flags.DEFINE_string("algo", "dp", "Communication method (see experiments/builders.py).")
_OPTIMIZER = flags.DEFINE_string("optimizer", "adamw", "Inner optimiser: adamw|adam|sgd|momentum.")
_STEPS = flags.DEFINE_integer("steps", 200, "Training steps.")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Global batch size.")
_SEQ = flags.DEFINE_integer("seq_len", 64, "LM sequence length.")
_LR = flags.DEFINE_float("lr", 3e-3, "Learning rate of the (inner) optimiser.")
_WD = flags.DEFINE_float("weight_decay", 0.0, "Weight decay of adamw.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices (CPU runs only).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/train", "Where metrics and summaries go.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for parameters and data order.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 10, "Log metrics every N steps.")
_REDUCE_DTYPE = flags.DEFINE_string("reduce_dtype", None, "dp: dtype gradients travel in.")
_D_MODEL = flags.DEFINE_integer("d_model", 64, "LM width.")
_LAYERS = flags.DEFINE_integer("num_layers", 2, "LM depth.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "LM attention heads.")
_SKIP_NONFINITE = flags.DEFINE_bool(
    "skip_nonfinite", False, "Skip steps whose gradient is not finite on any worker.")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 100, "Save a checkpoint every N steps (0: no checkpoints).")
_KEEP = flags.DEFINE_integer("keep", 3, "Checkpoints to keep.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "host:port of process 0 for a multi-process run.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes of a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout", 100, "Seconds after which a silent process is declared dead and the "
    "others abort (multi-process runs).")
_TOPOLOGY = flags.DEFINE_string("topology", "ring", "dpsgd/choco: gossip graph (ring, torus, "
                                "exponential, complete, one_peer_exponential).")
_GOSSIP_CODEC = flags.DEFINE_string("gossip_codec", "bfloat16", "choco: codec of the gossip.")
_CONSENSUS_STEP = flags.DEFINE_float("consensus_step", 0.5, "choco: consensus step size.")
_DELAY = flags.DEFINE_integer("delay", 1, "stale: staleness tau, in updates.")
_COMPENSATION = flags.DEFINE_enum("compensation", "none", ["none", "dc"],
                                  "stale, streaming_diloco: delay compensation (dc: DC-ASGD; "
                                  "CoCoDC-style for streaming).")
_DC_LAMBDA = flags.DEFINE_float("dc_lambda", 0.04, "stale, streaming_diloco: DC lambda "
                                "(outer gradients are small: streaming wants a larger one).")
_MICRO_BATCHES = flags.DEFINE_string("micro_batches", "1", "acco: micro-batches per worker "
                                     "and round, N or one count per worker (n0,n1,...).")
# --algo=compressed (experiments/algos_compression.py); they go into cfg.extra.
_CODEC = flags.DEFINE_string("codec", "top_k", "compressed: codec (see algos_compression.CODECS).")
_MEMORY = flags.DEFINE_enum("memory", "ef", ["none", "ef", "ef21", "loco"], "compressed: memory.")
_COLLECTIVE = flags.DEFINE_enum("collective", "auto", ["auto", "psum", "gather", "two_phase"],
                                "compressed: how payloads are summed.")
_FRACTION = flags.DEFINE_float("fraction", 0.01, "compressed: fraction kept by sparsifiers.")
_BITS = flags.DEFINE_integer("bits", 4, "compressed: code width of quantisers.")
_CHUNK = flags.DEFINE_integer("chunk", None, "compressed: chunk / block size of the codec.")
# --algo=powersgd|lq_sgd|onebit_adam|demo (experiments/algos_lowrank.py); also --bits,
# --collective, --chunk, --memory=none (no error feedback).
_RANK = flags.DEFINE_integer("rank", 2, "powersgd/lq_sgd: rank.")
_START_ITER = flags.DEFINE_integer("start_iter", 0, "powersgd/lq_sgd: exact steps first.")
_ALPHA = flags.DEFINE_float("alpha", 10.0, "lq_sgd: log-quantisation curvature.")
_FREEZE = flags.DEFINE_integer("freeze_step", 100, "onebit_adam: exact Adam steps first.")
_BETA = flags.DEFINE_float("beta", 0.999, "demo: momentum decay.")
_K = flags.DEFINE_integer("k", 32, "demo: DCT coefficients sent per tile.")


# Layouts with a sequence or pipeline axis (experiments/layouts_sequence.py).
_MESH = flags.DEFINE_string("mesh", "", "Mesh axes, e.g. data=2,sequence=4 or "
                            "data=2,fsdp=2,tensor=2 (default: data=all). Axes data, fsdp, tensor "
                            "(experiments/algos_parallel.py); sequence or pipeline "
                            "(experiments/layouts_sequence.py).")
_ATTENTION = flags.DEFINE_string("attention", None, "Sequence axis: ring|ring_zigzag|ulysses|"
                                 "linear_lasp2|linear_allscan|linear_lasp_ring.")
_SCHEDULE = flags.DEFINE_string("schedule", None, "Pipeline axis: gpipe|1f1b.")
_MICROBATCHES = flags.DEFINE_integer("microbatches", None, "Pipeline micro-batches.")


# Local-update methods (experiments/algos_local.py); they reach the builders via cfg.extra.
_SYNC_EVERY = flags.DEFINE_integer("sync_every", 10, "Local methods: H, steps between syncs.")
_FRAGMENTS = flags.DEFINE_integer("fragments", 2, "streaming_diloco: fragments.")
_OVERLAP = flags.DEFINE_integer("overlap", 0, "streaming_diloco: steps a sync overlaps.")
_MERGE_ALPHA = flags.DEFINE_float("merge_alpha", 0.5,
                                  "streaming_diloco: local weight at the merge.")
_OUTER_CODEC = flags.DEFINE_string("outer_codec", None, "Local methods: outer-gradient codec: "
                                   "none|identity|bf16|fp16|fp8|auto (default: the method's).")
_OUTER_MEMORY = flags.DEFINE_boolean("outer_memory", False,
                                     "diloco: error feedback on the outer codec.")
_PARTICIPATION = flags.DEFINE_string("participation", None,
                                     "Live workers per sync: drop:W1,W2@K1,K2 or random:RATE.")
_OUTER_LR = flags.DEFINE_float("outer_lr", None, "Outer learning rate (diloco 0.7, "
                               "sparseloco 1.0).")
_OUTER_MOMENTUM = flags.DEFINE_float("outer_momentum", 0.9, "Outer Nesterov momentum.")
_DENSITY = flags.DEFINE_float("density", 0.02, "sparseloco: top-k density per chunk.")
_SPARSE_BITS = flags.DEFINE_integer("sparse_bits", 2, "sparseloco: bits per value (0: float32).")
_WORKER_STEPS = flags.DEFINE_list("worker_steps", None, "hierarchical: steps per period of "
                                  "each slow worker.")
_WEIGHTING = flags.DEFINE_string("weighting", "uniform", "hierarchical: uniform|steps.")
_HIERARCHY = flags.DEFINE_string("hierarchy", None, "hierarchical: the two mesh axes, slow "
                                 "first, as name:size,name:size (e.g. slow:2,fast:4).")
_LABEL_SKEW = flags.DEFINE_float("label_skew", 0.0, "MLP: Dirichlet alpha of a label-skewed "
                                 "split across workers (0: identical data).")


_SP = flags.DEFINE_bool("sequence_parallel", False, "LM: Megatron sequence parallelism.")
_CM = flags.DEFINE_bool("collective_matmul", False,
                        "LM with --sequence_parallel: overlap the all-gather with the matmul.")
# --algo=zero1|zero2 (experiments/algos_parallel.py): the codec takes --bits/--chunk/--fraction.
_ZERO_CODEC = flags.DEFINE_string("zero_codec", "none", "zero1/zero2: codec of the gradient "
                                  "reduce-scatter (none, or a name of algos_compression.CODECS).")
_ZERO_MEMORY = flags.DEFINE_enum("zero_memory", "none", ["none", "ef"],
                                 "zero1/zero2: error memory of the compressed reduce-scatter.")


# Method-specific flags, passed to the builders in `cfg.extra` (one name a line).
EXTRA_FLAGS = (
    "alpha",
    "attention",
    "beta",
    "bits",
    "chunk",
    "codec",
    "collective",
    "collective_matmul",
    "compensation",
    "consensus_step",
    "dc_lambda",
    "delay",
    "density",
    "fraction",
    "fragments",
    "freeze_step",
    "gossip_codec",
    "k",
    "label_skew",
    "memory",
    "merge_alpha",
    "mesh",
    "micro_batches",
    "microbatches",
    "outer_codec",
    "outer_memory",
    "outer_momentum",
    "overlap",
    "participation",
    "rank",
    "schedule",
    "sequence_parallel",
    "sparse_bits",
    "start_iter",
    "sync_every",
    "topology",
    "weighting",
    "zero_codec",
    "zero_memory",
)
FLAGS = flags.FLAGS
PREEMPTED = 128 + 15  # exit status of a run stopped by SIGTERM after saving (143)


def hierarchy_from_flag(spec):
  """None, or the {slow: n, fast: m} mesh of `name:size,name:size` (hierarchical runs)."""
  if not spec:
    return None
  try:
    shape = {name: int(size) for name, size in (a.split(":") for a in spec.split(","))}
  except ValueError as e:
    raise ValueError(f"--hierarchy {spec!r}: expected name:size,name:size.") from e
  if len(shape) != 2:
    raise ValueError(f"--hierarchy {spec!r}: expected two axes, slow first.")
  return shape


def local_extra(mesh_shape):
  """cfg.extra entries the local-update methods read (experiments/algos_local.py)."""
  names = tuple(mesh_shape)
  extra = {"num_workers": int(np.prod(list(mesh_shape.values())))}
  if _OUTER_LR.value is not None:
    extra["outer_lr"] = _OUTER_LR.value
  if _WORKER_STEPS.value:
    extra["worker_steps"] = [int(s) for s in _WORKER_STEPS.value]
  if len(names) == 2:  # hierarchical: the first axis is the slow one
    extra.update(slow_axis=names[0], fast_axis=names[1], num_slow=mesh_shape[names[0]])
  return extra


def config_from_flags(mesh_shape=None):
  from experiments import builders  # pylint: disable=import-outside-toplevel
  dataset = _DATASET.value or ("pydoc" if _MODEL.value == "lm" else "digits")
  mesh_shape = mesh_shape or {"data": 1}
  axes = tuple(mesh_shape)
  return builders.Config(
      axis_name=axes[0] if len(axes) == 1 else axes,
      model=_MODEL.value, dataset=dataset, algo=_ALGO.value, optimizer=_OPTIMIZER.value,
      lr=_LR.value, weight_decay=_WD.value, steps=_STEPS.value, batch_size=_BATCH.value,
      seq_len=_SEQ.value, seed=_SEED.value, reduce_dtype=_REDUCE_DTYPE.value,
      d_model=_D_MODEL.value, num_layers=_LAYERS.value, num_heads=_HEADS.value,
      d_ff=4 * _D_MODEL.value,
      extra={**{name: getattr(FLAGS, name) for name in EXTRA_FLAGS},
             **local_extra(mesh_shape)})


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  if _DEVICES.value:
    jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  from jaxcomm import comm, parallel, sync, train  # pylint: disable=import-outside-toplevel
  from experiments import elastic_run  # pylint: disable=import-outside-toplevel
  # First, before any computation: joins the other processes of a multi-process run.
  if elastic_run.requested():  # processes may die and rejoin (experiments/elastic_run.py)
    from jaxcomm import elastic  # pylint: disable=import-outside-toplevel
    elastic.start_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                              heartbeat_timeout_s=_HEARTBEAT.value,
                              collective_timeout_s=elastic_run.collective_timeout_s())
  else:
    train.start_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                            heartbeat_timeout_s=_HEARTBEAT.value)
  from experiments import algos_parallel  # pylint: disable=import-outside-toplevel
  from experiments import builders  # pylint: disable=import-outside-toplevel
  from experiments import layouts_sequence  # pylint: disable=import-outside-toplevel
  from jaxcomm import data  # pylint: disable=import-outside-toplevel

  hierarchy = hierarchy_from_flag(_HIERARCHY.value)
  mesh_shape = hierarchy or algos_parallel.parse_train_mesh(_MESH.value, jax.device_count())
  cfg = config_from_flags(mesh_shape if hierarchy else {"data": mesh_shape.get("data", 1)})
  workdir = _WORKDIR.value
  _check_same_run(workdir, cfg)
  mesh = train.make_mesh(mesh_shape)
  layout = None
  if hierarchy is None and {"sequence", "pipeline"} & set(mesh_shape):
    layout = layouts_sequence.build(cfg, mesh_shape)
    cfg.axis_name = layout.axis_name
  elif hierarchy is None and {"fsdp", "tensor"} & set(mesh_shape):
    layout = parallel.Layout(mesh, sequence_parallel=_SP.value, collective_matmul=_CM.value)
    if cfg.model != "lm":
      raise ValueError(f"--mesh={_MESH.value} lays out the LM only; use --model=lm.")
  if isinstance(layout, parallel.Layout):  # data x fsdp x tensor (experiments/algos_parallel.py)
    cfg.extra["layout"] = layout
    model, loss_fn, params, batch_fn, has_aux = builders.make_task(cfg)
    specs = layout.param_specs(model.param_axes(), params)
    tx = algos_parallel.layout_optimizer(cfg, layout, specs, model.param_regather())
  else:
    tx = builders.make_optimizer(cfg)
  if _SKIP_NONFINITE.value:
    tx = sync.skip_nonfinite(tx, layout.batch_axes if isinstance(layout, parallel.Layout)
                             else cfg.axis_name)
  if isinstance(layout, parallel.Layout):
    loss_fn = builders.task_loss(cfg, loss_fn)  # e.g. acco: over a worker's micro-batches
    trainer = train.Trainer(loss_fn, tx, mesh, axis_name=layout.batch_axes, param_specs=specs,
                            has_aux=has_aux)
  elif layout is None:
    _, loss_fn, params, batch_fn, has_aux = builders.make_task(cfg)
    loss_fn = builders.task_loss(cfg, loss_fn)  # e.g. acco: over a worker's micro-batches
    trainer = train.Trainer(loss_fn, tx, mesh, axis_name=cfg.axis_name, has_aux=has_aux)
    if _LABEL_SKEW.value:  # each worker's slice of the batch from its own skewed shard
      skewed = data.label_skew(data.load(cfg.dataset), trainer.num_workers, _LABEL_SKEW.value,
                               seed=cfg.seed)
      batch_fn = lambda t: skewed.batch(t, cfg.batch_size, seed=cfg.seed,
                                        process_index=jax.process_index(),
                                        process_count=jax.process_count())
  else:
    params, batch_fn = layout.params, layout.batch_fn
    trainer = train.Trainer(layout.loss_fn, tx, mesh, axis_name=layout.axis_name,
                            param_specs=layout.param_specs, batch_specs=layout.batch_specs)
  if elastic_run.requested():
    if layout is not None or hierarchy or _LABEL_SKEW.value:
      raise ValueError("elastic runs train on one data axis: no --mesh layouts, "
                       "--hierarchy or --label_skew.")
    elastic_run.run(lambda m: train.Trainer(loss_fn, tx, m, axis_name=cfg.axis_name,
                                            has_aux=has_aux),
                    params, elastic_run.with_kill_switch(batch_fn), steps=cfg.steps,
                    round_steps=elastic_run.round_steps(cfg.algo, _SYNC_EVERY.value),
                    workdir=workdir, checkpoint_every=_CHECKPOINT_EVERY.value,
                    keep=_KEEP.value, log_every=_LOG_EVERY.value)
    return
  batch_fn = elastic_run.with_kill_switch(batch_fn)  # launch_local --kill (JAXCOMM_KILL_AT)
  state = trainer.init(params)
  checkpointer = None
  if _CHECKPOINT_EVERY.value:
    checkpointer = train.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      every=_CHECKPOINT_EVERY.value, keep=_KEEP.value)
  state, _ = train.fit(trainer, state, batch_fn, cfg.steps, workdir=workdir,
                       log_every=_LOG_EVERY.value, checkpointer=checkpointer)
  if checkpointer is not None:
    checkpointer.close()
  if int(state.step) < cfg.steps:  # preempted: the checkpoint of this step is on disk
    print(f"preempted at step {int(state.step)} of {cfg.steps}: saved a checkpoint in "
          f"{checkpointer.directory}; run the same command to resume.", file=sys.stderr)
    sys.exit(PREEMPTED)
  if jax.process_index() != 0:
    return
  # The whole run's record, across resumptions, is metrics.jsonl.
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    last = ([json.loads(line) for line in f if line.strip()] or [{}])[-1]
  dp_bytes = comm.allreduce_bytes(comm.tree_bytes(params), trainer.num_workers)
  steps_done = int(state.step)
  per_step = last.get("total_wire_bytes", 0) / max(steps_done, 1)
  summary = {
      "algo": cfg.algo, "model": cfg.model, "dataset": cfg.dataset, "steps": steps_done,
      "workers": trainer.num_workers, "processes": jax.process_count(),
      "final_loss": last.get("loss"), "skipped_steps": last.get("skipped_steps", 0),
      "wire_bytes_per_step": per_step, "dp_wire_bytes_per_step": dp_bytes,
      "compression_ratio": dp_bytes / per_step if per_step else float("inf"),
  }
  if layout is not None:
    # Activation traffic (K/V rotations, all-to-alls, pipeline sends) is not in the optimiser's
    # counters: read every collective of the compiled step.
    batch = trainer.shard_batch(batch_fn(0))
    report = comm.inspect(trainer.step_fn(state, batch), state, batch, mesh=mesh)
    summary["mesh"] = mesh_shape
    summary["step_wire_bytes_by_axis"] = {",".join(k) or "?": v
                                          for k, v in report.by_axis().items()}
  with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  print(f"{cfg.algo} on {cfg.model}/{cfg.dataset}, mesh {dict(mesh.shape)}, "
        f"{trainer.num_workers} workers in {jax.process_count()} process(es), "
        f"{steps_done} steps")
  if summary["final_loss"] is not None:
    print(f"  final loss            {summary['final_loss']:.4f}")
  print(f"  wire bytes per step   {per_step:,.0f} (exact DP: {dp_bytes:,.0f})")
  print(f"  compression ratio     {summary['compression_ratio']:.2f}x")
  if layout is not None:
    print(f"  mesh {mesh_shape}: compiled step wire bytes by axis "
          f"{ {k: f'{v:,.0f}' for k, v in summary['step_wire_bytes_by_axis'].items()} }")


def _check_same_run(workdir: str, cfg) -> None:
  """Refuses to resume a --workdir written with other settings; records them otherwise.

  Every field of the Config counts (method settings in `cfg.extra` included) except the
  number of steps, which a resumed run may extend.
  """
  import jax  # pylint: disable=import-outside-toplevel
  settings = dataclasses.asdict(cfg)
  settings.pop("steps")
  settings["skip_nonfinite"] = _SKIP_NONFINITE.value
  settings = json.loads(json.dumps(settings, default=str))  # as it reads back from disk
  path = os.path.join(workdir, "config.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    changed = {k: (saved.get(k), settings.get(k)) for k in set(saved) | set(settings)
               if saved.get(k) != settings.get(k)}
    if changed:
      raise ValueError(f"--workdir {workdir} holds a run with other settings "
                       f"{{setting: (saved, now)}}: {changed}; use another --workdir.")
  elif jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      json.dump(settings, f, indent=2)
    os.replace(path + ".tmp", path)  # the other processes read it whole or not at all


if __name__ == "__main__":
  app.run(main)
