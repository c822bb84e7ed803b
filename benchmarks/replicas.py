r"""Every method over replicas of a sharded LM: bytes per step per mesh axis, peak memory.

  python -m benchmarks.replicas --out=runs/replicas.json

The LM is laid out on `replica=2,fsdp=2,tensor=2` (8 emulated CPU devices): ZeRO-3 over
`fsdp` and Megatron tensor parallelism inside each replica, the method over `replica`
(`parallel.Layout.optimizer`). Each method's step is compiled once and read, not timed:
`comm.inspect` gives the bytes one device sends per mesh axis, averaged over the schedule
(a collective in a sync branch counts `syncs_per_step` of its bytes: 1/H for DiLoCo), and
the compiled memory analysis gives the per-device peak with the train state donated to the
step (as `Trainer` does) and without. `zero3` is the baseline of ZeRO-3 over
replica x fsdp (parameters sharded over both, every gather crossing the slow axis);
`zeropp` is ZeRO++ (qwZ, hpZ, qgZ; `parallel.zero`'s module docstring).
"""

from __future__ import annotations

import json
import os
import warnings

import jax
import jax.numpy as jnp
import optax
from absl import app, flags

from jaxcomm import codecs, comm, data, local, models, parallel, sync, train

_MESH = flags.DEFINE_string("mesh", "replica=2,fsdp=2,tensor=2", "The mesh.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Global batch size.")
_SEQ = flags.DEFINE_integer("seq_len", 64, "Sequence length.")
_D_MODEL = flags.DEFINE_integer("d_model", 128, "LM width.")
_LAYERS = flags.DEFINE_integer("num_layers", 2, "LM depth.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Heads.")
_H = flags.DEFINE_integer("sync_every", 8, "H of the local-update methods.")
_ONLY = flags.DEFINE_string("only", None, "Comma-separated method names to run.")
_OUT = flags.DEFINE_string("out", None, "Optional JSON output path.")


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


def build(name: str, factory, mesh_text: str, lm_kwargs: dict, donate: bool):
  """(trainer, state, batch) of one method on the laid-out LM."""
  mesh = parallel.make_mesh(mesh_text)
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
  trainer = train.Trainer(models.lm_loss(lm), tx, mesh, axis_name=layout.batch_axes,
                          param_specs=specs, donate=donate)
  batch = trainer.shard_batch(data.pydoc_text().batch(0, _BATCH.value, seq_len=_SEQ.value))
  return trainer, trainer.init(params), batch


def measure(name: str, factory, syncs: float, lm_kwargs: dict) -> dict:
  """Bytes per step per axis (schedule average) and peak memory, donated and not."""
  row = {"method": name, "mesh": _MESH.value}
  for donate in (True, False):
    trainer, state, batch = build(name, factory, _MESH.value, lm_kwargs, donate)
    compiled = trainer.step_fn(state, batch).lower(state, batch).compile()
    row["peak_bytes" if donate else "peak_bytes_undonated"] = (
        compiled.memory_analysis().peak_memory_in_bytes)
    if donate:
      report = comm.parse_hlo(compiled.as_text(), mesh=trainer.mesh)
      per_axis = {}
      for c in report:
        key = ",".join(c.axes) or "?"
        per_axis[key] = per_axis.get(key, 0.0) + c.total_bytes * (syncs if c.in_conditional
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
  jax.config.update("jax_num_cpu_devices", 8)
  lm_kwargs = dict(d_model=_D_MODEL.value, num_layers=_LAYERS.value, num_heads=_HEADS.value,
                   d_ff=4 * _D_MODEL.value, max_len=_SEQ.value)
  table_of = methods(_H.value)
  names = _ONLY.value.split(",") if _ONLY.value else list(table_of)
  rows = []
  for name in names:
    factory, syncs = table_of[name]
    rows.append(measure(name, factory, syncs, lm_kwargs))
    print(table(rows[-1:]).splitlines()[-1], flush=True)
  print(f"\nLM d_model={_D_MODEL.value} layers={_LAYERS.value} batch={_BATCH.value} "
        f"T={_SEQ.value} on {_MESH.value}; bytes per device per step (sync branches "
        f"weighted by syncs per step, H={_H.value}); memory per device.\n")
  print(table(rows))
  if _OUT.value:
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  app.run(main)
