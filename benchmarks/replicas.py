r"""Every method over replicas of a sharded LM: bytes per step per mesh axis, peak memory.

  python -m benchmarks.replicas --out=runs/replicas.json
  python -m benchmarks.replicas --config.only=dp,diloco --config.d_model=64

The LM is laid out on `replica=2,fsdp=2,tensor=2` (8 emulated CPU devices): ZeRO-3 over
`fsdp` and Megatron tensor parallelism inside each replica, the method over `replica`
(`parallel.Layout.optimizer`). Each method's step is compiled once and read, not timed:
`comm.inspect` gives the bytes one device sends per mesh axis, averaged over the schedule
(a collective in a sync branch counts `syncs_per_step` of its bytes: 1/H for DiLoCo), and
the compiled memory analysis gives the per-device peak with the train state donated to the
step (as `Trainer` does) and without. `zero3` is the baseline of ZeRO-3 over
replica x fsdp (parameters sharded over both, every gather crossing the slow axis);
`zeropp` is ZeRO++ (qwZ, hpZ, qgZ; `parallel.zero`'s module docstring). The settings are
`get_config()`'s (`--help` lists them).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import flags

from experiments import _cli
from experiments import toolkit
from jaxcomm import codecs, comm, data, local, models, parallel, sync, train


def get_config() -> ml_collections.ConfigDict:
  """The benchmark's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      mesh="replica=2,fsdp=2,tensor=2",
      batch_size=16, seq_len=64,            # global batch, sequence length
      d_model=128, num_layers=2, num_heads=4,  # the LM (its MLP 4 x d_model)
      sync_every=8,                          # H of the local-update methods
      only=""))                              # comma-separated method names ("": all)


def methods(h: int) -> dict:
  """name -> (fn(specs) -> method over `replica` with its optimiser, syncs per step)."""
  adamw = lambda: optax.adamw(1e-3)
  outer = lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)
  int8 = codecs.uniform(8, block=256)
  return {
      "dp": (lambda specs: optax.chain(sync.mean("replica"), adamw()), 1.0),
      "compressed_int8_ef": (lambda specs: optax.chain(
          sync.compressed(int8, memory="ef", axis_name="replica"), adamw()), 1.0),
      "top_k_1%_ef": (lambda specs: optax.chain(
          sync.compressed(codecs.top_k(0.01), memory="ef", axis_name="replica"), adamw()), 1.0),
      "powersgd_r4": (lambda specs: optax.chain(
          sync.powersgd(4, axis_name="replica", param_specs=specs), adamw()), 1.0),
      "demo": (lambda specs: sync.demo(1e-3, axis_name="replica"), 1.0),
      "diloco": (lambda specs: local.diloco(adamw(), outer(), h, "replica"), 1.0 / h),
      "streaming_diloco_p4": (lambda specs: local.streaming_diloco(
          adamw(), outer(), h, fragments=4, axis_name="replica"), 4.0 / h),
      "sparseloco": (lambda specs: local.sparseloco(adamw(), h, axis_name="replica"), 1.0 / h),
      "acco": (lambda specs: local.acco(adamw(), "replica"), 1.0),
      "zeropp": (lambda specs: parallel.zero(adamw(), 1, "replica", int8, "ef",
                                             gather_codec=int8), 1.0),
      "zero3": (None, 1.0),
  }


def build(name: str, factory, c, lm_kwargs: dict, donate: bool):
  """(trainer, state, batch) of one method on the laid-out LM."""
  mesh = parallel.make_mesh(c.mesh)
  rules = parallel.make_rules(embed=("replica", "fsdp")) if name == "zero3" else None
  layout = parallel.Layout(mesh, rules=rules) if rules else parallel.Layout(mesh)
  lm = models.TransformerLM(**lm_kwargs, layout=layout)
  params = models.TransformerLM(**lm_kwargs).init(
      jax.random.key(0), jnp.zeros((1, lm_kwargs["max_len"]), jnp.int32))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    specs = layout.param_specs(lm.param_axes(), params)
  method = optax.adamw(1e-3) if factory is None else factory(specs)
  tx = layout.optimizer(method, specs, lm.param_regather())
  trainer = train.Trainer(models.lm_loss(lm), tx, mesh, batch_axes=layout.batch_axes,
                          param_specs=specs, donate=donate)
  batch = trainer.shard_batch(data.pydoc_text().batch(0, c.batch_size, seq_len=c.seq_len))
  return trainer, trainer.init(params), batch


def measure(name: str, factory, syncs: float, c, lm_kwargs: dict) -> dict:
  """Bytes per step per axis (schedule average) and peak memory, donated and not."""
  row = {"method": name, "mesh": c.mesh}
  for donate in (True, False):
    trainer, state, batch = build(name, factory, c, lm_kwargs, donate)
    compiled = trainer.step_fn(state, batch).lower(state, batch).compile()
    row["peak_bytes" if donate else "peak_bytes_undonated"] = (
        compiled.memory_analysis().peak_memory_in_bytes)
    if donate:
      report = comm.parse_hlo(compiled.as_text(), mesh=trainer.mesh)
      per_axis = {}
      for op in report:
        key = ",".join(op.axes) or "?"
        per_axis[key] = per_axis.get(key, 0.0) + op.total_bytes * (syncs if op.in_conditional
                                                                   else 1.0)
      row["bytes_per_axis"] = per_axis
      row["state_bytes"] = sum(x.addressable_shards[0].data.nbytes
                               for x in jax.tree.leaves(state))
  return row


def table(rows) -> str:
  axes = ["replica", "fsdp", "tensor", "replica,fsdp"]
  head = (f"{'method':<22}" + "".join(f"{a + ' B/step':>21}" for a in axes) +
          f"{'state MiB':>11}{'peak MiB':>10}{'undonated':>11}")
  out = [head, "-" * len(head)]
  for r in rows:
    cells = "".join(f"{r['bytes_per_axis'].get(a, 0):>21,.0f}" for a in axes)
    out.append(f"{r['method']:<22}{cells}{r['state_bytes'] / 2**20:>11.2f}"
               f"{r['peak_bytes'] / 2**20:>10.2f}{r['peak_bytes_undonated'] / 2**20:>11.2f}")
  return "\n".join(out)


def main(argv):
  del argv
  c = flags.FLAGS.config
  for name in ("batch_size", "seq_len", "d_model", "num_layers", "num_heads", "sync_every"):
    toolkit.int_at_least(c, name, 1)
  table_of = methods(c.sync_every)
  names = toolkit.names_in(c, "only", table_of)
  jax.config.update("jax_num_cpu_devices", 8)
  lm_kwargs = dict(d_model=c.d_model, num_layers=c.num_layers, num_heads=c.num_heads,
                   d_ff=4 * c.d_model, max_len=c.seq_len)
  rows = []
  for name in names:
    factory, syncs = table_of[name]
    rows.append(measure(name, factory, syncs, c, lm_kwargs))
    print(table(rows[-1:]).splitlines()[-1], flush=True)
  print(f"\nLM d_model={c.d_model} layers={c.num_layers} batch={c.batch_size} "
        f"T={c.seq_len} on {c.mesh}; bytes per device per step (sync branches "
        f"weighted by syncs per step, H={c.sync_every}); memory per device.\n")
  print(table(rows))
  _cli.write_json(flags.FLAGS.out, rows)


if __name__ == "__main__":
  _cli.run(main, get_config(), out=True)
