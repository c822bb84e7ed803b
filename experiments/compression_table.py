r"""Floats sent per step and compression ratio of every compressor, read from compiled programs.

  python -m experiments.compression_table --devices=8 --config.models=resnet18,lm

For each model (ResNet-18 on CIFAR-10 shapes, 11.2M parameters; the experiments' default LM)
and each method, the gradient synchronisation step is compiled (never run) on a mesh of
--devices emulated devices with abstract per-worker gradients, and `comm.inspect` reads
every collective of the optimised program. The table gives the wire bytes per device per
step as float32 equivalents (bytes / 4) and the ratio to exact data parallelism; the bytes
the transform counts in its state are checked against the compiled program. 1-bit Adam is
shown after its freeze step (freeze_step=0); methods with a warm-up count their
compressed steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _cli, config, toolkit
from jaxcomm import codecs, comm, models, sync, train

MODELS = ("resnet18", "lm")


def get_config() -> ml_collections.ConfigDict:
  """The table's settings (`--config.<name>=<value>`): the models compiled, comma-separated
  names out of MODELS."""
  return ml_collections.ConfigDict(dict(models=",".join(MODELS)))


def methods():
  """(name, transform factory) for every compressor in the table."""
  key = jax.random.key(0)
  return [
      ("exact DP (f32 all-reduce)", lambda: sync.mean()),
      ("PowerSGD rank 1", lambda: sync.powersgd(1)),
      ("PowerSGD rank 2", lambda: sync.powersgd(2)),
      ("PowerSGD rank 4", lambda: sync.powersgd(4)),
      ("LQ-SGD rank 4, 8-bit log, two-phase", lambda: sync.lq_sgd(4, bits=8)),
      ("top-k 1% + EF (gather)", lambda: sync.compressed(codecs.top_k(0.01), memory="ef")),
      ("QSGD 7 levels, bucket 512 (two-phase)",
       lambda: sync.compressed(codecs.qsgd(7), key=key)),
      ("sign + EF (two-phase)", lambda: sync.compressed(codecs.sign(), memory="ef")),
      ("1-bit Adam after freeze (two-phase)", lambda: sync.onebit_adam(1e-3, freeze_step=0)),
      ("DeMo chunk 64, k 32 (gather)", lambda: sync.demo(1e-3)),
  ]


def model_params(name: str):
  """Abstract parameters (ShapeDtypeStructs) of a model."""
  if name == "resnet18":
    return jax.eval_shape(models.ResNet18().init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
  if name == "lm":  # the experiments' default LM (experiments/config.py)
    c = config.base_config()
    lm = models.TransformerLM(d_model=c.model.d_model, num_layers=c.model.num_layers,
                              num_heads=c.model.num_heads, d_ff=c.model.d_ff,
                              max_len=c.data.seq_len)
    return jax.eval_shape(lm.init, jax.random.key(0), jnp.zeros((1, c.data.seq_len),
                                                                 jnp.int32))
  raise ValueError(f"model must be one of 'resnet18', 'lm'; got {name!r}.")


def sync_bytes(tx, params, mesh, axis_name="data"):
  """(bytes counted in state, bytes read from the compiled program) of one update of `tx`.

  The program takes every worker's gradient ([W, ...] sharded over `axis_name`), initialises
  the transform's state inside (so per-worker state needs no layout) and applies one update.
  """
  w = mesh.shape[axis_name]

  def local(grads_block):
    grads = jax.tree.map(lambda x: x[0], grads_block)
    zeros = jax.tree.map(jnp.zeros_like, grads)
    # The barrier keeps XLA from folding the initial state's constants into the update: a
    # frozen variance of zeros would mask 1-bit Adam's whole momentum and let XLA drop the
    # collectives that a real step (state read from memory) runs.
    state = jax.lax.optimization_barrier(tx.init(zeros))
    updates, new_state = tx.update(grads, state, zeros)
    sent = comm.counted_bytes(new_state) - comm.counted_bytes(state)
    return updates, sent

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(axis_name),), out_specs=(P(), P())))
  sharding = NamedSharding(mesh, P(axis_name))
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((w, *x.shape), x.dtype, sharding=sharding),
                       params)
  compiled = fn.lower(grads).compile()
  report = comm.inspect(fn, grads, mesh=mesh)
  # The counter is a compile-time constant of the program: evaluate it on zeros.
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), grads)
  counted = int(compiled(zeros)[1])
  return counted, report.wire_bytes()


def main(argv):
  del argv
  names = toolkit.names_in(flags.FLAGS.config, "models", MODELS)
  jax.config.update("jax_num_cpu_devices", flags.FLAGS.devices)
  mesh = train.make_mesh({"data": jax.device_count()})
  w = jax.device_count()
  rows = {name: {} for name, _ in methods()}
  sizes = {}
  for model in names:
    params = model_params(model)
    sizes[model] = sum(x.size for x in jax.tree.leaves(params))
    for name, make in methods():
      counted, inspected = sync_bytes(make(), params, mesh)
      if counted != round(inspected):
        raise AssertionError(f"{model} {name}: counted {counted} bytes, compiled {inspected}")
      rows[name][model] = counted
  head = f"{'method':40s}" + "".join(
      f" | {m + ' floats/step':>22s} {'ratio':>8s}" for m in names)
  print(f"W = {w} devices; wire floats = bytes sent per device per step / 4; ratio = exact DP / "
        f"method; parameters: " + ", ".join(f"{m} {sizes[m]:,}" for m in names))
  print(head)
  print("-" * len(head))
  dp = rows[methods()[0][0]]
  for name, per_model in rows.items():
    print(f"{name:40s}" + "".join(
        f" | {per_model[m] / 4:>22,.0f} {dp[m] / per_model[m]:>7.1f}x" for m in names))


if __name__ == "__main__":
  _cli.run(main, get_config(), devices=8)
