r"""Trains a model with one communication method on a mesh of (emulated) devices.

  python -m experiments.train --model=lm --algo=dp --steps=200 --workdir=runs/dp

Writes `metrics.jsonl` and `summary.json` into --workdir and prints a summary: final loss,
wire bytes per step, and the compression ratio against exact data parallelism.
"""

from __future__ import annotations

import json
import os

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
_MESH = flags.DEFINE_string("mesh", None, "Mesh axes for the LM, e.g. data=2,fsdp=2,tensor=2 "
                            "(axes: data, fsdp, tensor; default data=<all devices>).")
_SP = flags.DEFINE_bool("sequence_parallel", False, "LM: Megatron sequence parallelism.")
_CM = flags.DEFINE_bool("collective_matmul", False,
                        "LM with --sequence_parallel: overlap the all-gather with the matmul.")
_ZERO_CODEC = flags.DEFINE_enum("zero_codec", "none", ["none", "bf16", "int8"],
                                "zero1/zero2: codec of the gradient reduce-scatter.")
_ZERO_MEMORY = flags.DEFINE_enum("zero_memory", None, ["ef"],
                                 "zero1/zero2: error memory of the compressed reduce-scatter.")


def config_from_flags():
  from experiments import builders  # pylint: disable=import-outside-toplevel
  dataset = _DATASET.value or ("pydoc" if _MODEL.value == "lm" else "digits")
  return builders.Config(
      model=_MODEL.value, dataset=dataset, algo=_ALGO.value, optimizer=_OPTIMIZER.value,
      lr=_LR.value, weight_decay=_WD.value, steps=_STEPS.value, batch_size=_BATCH.value,
      seq_len=_SEQ.value, seed=_SEED.value, reduce_dtype=_REDUCE_DTYPE.value,
      d_model=_D_MODEL.value, num_layers=_LAYERS.value, num_heads=_HEADS.value,
      d_ff=4 * _D_MODEL.value)


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  if _DEVICES.value:
    jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  from experiments import builders  # pylint: disable=import-outside-toplevel
  from experiments import algos_parallel  # pylint: disable=import-outside-toplevel
  from jaxcomm import comm, parallel, train  # pylint: disable=import-outside-toplevel

  cfg = config_from_flags()
  cfg.extra.update(zero_codec=_ZERO_CODEC.value, zero_memory=_ZERO_MEMORY.value)
  mesh = parallel.make_mesh(_MESH.value or {"data": jax.device_count()})
  layout = parallel.Layout(mesh, sequence_parallel=_SP.value, collective_matmul=_CM.value)
  if cfg.model == "lm":
    cfg.extra["layout"] = layout
  elif set(mesh.axis_names) - set(parallel.BATCH_AXES) or layout.gather_axes:
    raise ValueError(f"--mesh={_MESH.value} lays out the LM only; use --model=lm.")
  model, loss_fn, params, batch_fn, has_aux = builders.make_task(cfg)
  specs = None
  if cfg.model == "lm":
    specs = layout.param_specs(model.param_axes(), params)
    tx = algos_parallel.layout_optimizer(cfg, layout, specs, model.param_regather())
  else:
    tx = builders.make_optimizer(cfg)
  trainer = train.Trainer(loss_fn, tx, mesh, axis_name=layout.batch_axes, param_specs=specs,
                          has_aux=has_aux)
  state = trainer.init(params)
  state, history = train.fit(trainer, state, batch_fn, cfg.steps, workdir=_WORKDIR.value,
                             log_every=_LOG_EVERY.value)
  dp_bytes = comm.allreduce_bytes(comm.tree_bytes(params), trainer.num_workers)
  total = history[-1]["total_wire_bytes"] if history else 0
  per_step = total / max(cfg.steps, 1)
  summary = {
      "algo": cfg.algo, "model": cfg.model, "dataset": cfg.dataset, "steps": cfg.steps,
      "workers": trainer.num_workers, "final_loss": history[-1]["loss"] if history else None,
      "wire_bytes_per_step": per_step, "dp_wire_bytes_per_step": dp_bytes,
      "compression_ratio": dp_bytes / per_step if per_step else float("inf"),
  }
  if jax.process_index() == 0:
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(os.path.join(_WORKDIR.value, "summary.json"), "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=2)
    print(f"{cfg.algo} on {cfg.model}/{cfg.dataset}, mesh {dict(mesh.shape)}, "
          f"{trainer.num_workers} workers, {cfg.steps} steps")
    print(f"  final loss            {summary['final_loss']:.4f}")
    print(f"  wire bytes per step   {per_step:,.0f} (exact DP: {dp_bytes:,.0f})")
    print(f"  compression ratio     {summary['compression_ratio']:.2f}x")


if __name__ == "__main__":
  app.run(main)
