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
_K = flags.DEFINE_integer("k", 32, "demo: DCT coefficients sent per chunk.")


def config_from_flags():
  from experiments import builders  # pylint: disable=import-outside-toplevel
  dataset = _DATASET.value or ("pydoc" if _MODEL.value == "lm" else "digits")
  return builders.Config(
      model=_MODEL.value, dataset=dataset, algo=_ALGO.value, optimizer=_OPTIMIZER.value,
      lr=_LR.value, weight_decay=_WD.value, steps=_STEPS.value, batch_size=_BATCH.value,
      seq_len=_SEQ.value, seed=_SEED.value, reduce_dtype=_REDUCE_DTYPE.value,
      d_model=_D_MODEL.value, num_layers=_LAYERS.value, num_heads=_HEADS.value,
      d_ff=4 * _D_MODEL.value,
      extra={"codec": _CODEC.value, "memory": _MEMORY.value, "collective": _COLLECTIVE.value,
             "fraction": _FRACTION.value, "bits": _BITS.value, "chunk": _CHUNK.value,
             "rank": _RANK.value, "start_iter": _START_ITER.value, "alpha": _ALPHA.value,
             "freeze_step": _FREEZE.value, "beta": _BETA.value, "k": _K.value})


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  if _DEVICES.value:
    jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  from experiments import builders  # pylint: disable=import-outside-toplevel
  from jaxcomm import comm, train  # pylint: disable=import-outside-toplevel

  cfg = config_from_flags()
  tx = builders.make_optimizer(cfg)
  _, loss_fn, params, batch_fn, has_aux = builders.make_task(cfg)
  mesh = train.make_mesh({"data": jax.device_count()})
  trainer = train.Trainer(loss_fn, tx, mesh, axis_name="data", has_aux=has_aux)
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
    print(f"{cfg.algo} on {cfg.model}/{cfg.dataset}, {trainer.num_workers} workers, "
          f"{cfg.steps} steps")
    print(f"  final loss            {summary['final_loss']:.4f}")
    print(f"  wire bytes per step   {per_step:,.0f} (exact DP: {dp_bytes:,.0f})")
    print(f"  compression ratio     {summary['compression_ratio']:.2f}x")


if __name__ == "__main__":
  app.run(main)
