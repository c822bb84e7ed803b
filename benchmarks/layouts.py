r"""Wire bytes per step by mesh axis and compiled memory per device, for each LM layout.

  python -m benchmarks.layouts --seq_lens=64,256 --out=runs/layouts.json

Every layout trains the same transformer LM (one training step: forward, backward,
gradient mean, AdamW) on 8 emulated CPU devices. For each layout and sequence length the
step is compiled once and read, not timed: `comm.inspect` gives the bytes each device puts
on the wire per mesh axis (every collective of the optimised program), and the compiled
program's memory analysis gives the per-device bytes of temporaries and of arguments
(parameters, optimiser state and the batch shard).

Layouts are registered with `@layout(name)`; a builder returns a Trainer ready to step: DP,
ZeRO 1/2/3, TP, TP+SP and data x fsdp x tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from absl import app
from absl import flags

_SEQ_LENS = flags.DEFINE_string("seq_lens", "64,256", "Comma-separated sequence lengths.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Global batch size.")
_D_MODEL = flags.DEFINE_integer("d_model", 64, "LM width.")
_LAYERS = flags.DEFINE_integer("num_layers", 4, "LM depth (divisible by the pipeline axis).")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Heads (divisible by the sequence axis).")
_ONLY = flags.DEFINE_string("only", None, "Comma-separated layout names to run.")
_OUT = flags.DEFINE_string("out", None, "Optional JSON output path.")

LAYOUTS: dict[str, Callable] = {}


def layout(name: str):
  """Registers `fn(cfg) -> (mesh_shape, trainer, params, numpy batch)` under `name`."""

  def register(fn):
    LAYOUTS[name] = fn
    return fn

  return register


def _trainer_for(cfg, mesh_shape, extra=None):
  from experiments import builders, layouts_sequence  # pylint: disable=import-outside-toplevel
  from jaxcomm import train  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(cfg, extra=dict(extra or {}))
  mesh = train.make_mesh(mesh_shape)
  if set(mesh_shape) == {"data"}:
    _, loss_fn, params, batch_fn, has_aux = builders.make_task(cfg)
    trainer = train.Trainer(loss_fn, builders.make_optimizer(cfg), mesh, has_aux=has_aux)
    return trainer, params, batch_fn(0)
  built = layouts_sequence.build(cfg, mesh_shape)
  cfg = dataclasses.replace(cfg, axis_name=built.axis_name)
  trainer = train.Trainer(built.loss_fn, builders.make_optimizer(cfg), mesh,
                          axis_name=built.axis_name, param_specs=built.param_specs,
                          batch_specs=built.batch_specs)
  return trainer, built.params, built.batch_fn(0)


@layout("dp")
def _dp(cfg):
  return {"data": 8}, *_trainer_for(cfg, {"data": 8})


def _sequence(attention):
  def build(cfg):
    shape = {"data": 2, "sequence": 4}
    return shape, *_trainer_for(cfg, shape, {"attention": attention})
  return build


for _name in ("ring", "ring_zigzag", "ulysses", "linear_lasp2", "linear_allscan",
              "linear_lasp_ring"):
  layout(_name)(_sequence(_name))


def _pipeline(schedule, microbatches):
  def build(cfg):
    shape = {"data": 2, "pipeline": 4}
    return shape, *_trainer_for(cfg, shape, {"schedule": schedule,
                                             "microbatches": microbatches})
  return build


for _micro in (4, 8):  # M = S and M = 2S: GPipe's activations grow with M, 1F1B's do not
  layout(f"gpipe_m{_micro}")(_pipeline("gpipe", _micro))
  layout(f"1f1b_m{_micro}")(_pipeline("1f1b", _micro))


def _zero(stage):
  def build(cfg):
    from experiments import builders  # pylint: disable=import-outside-toplevel
    return {"data": 8}, *_trainer_for(dataclasses.replace(cfg, algo=f"zero{stage}"),
                                      {"data": 8})
  return build


def _laid_out(mesh_shape, **options):
  """The LM under a `parallel.Layout` (data / fsdp / tensor axes; issue 7)."""
  def build(cfg):
    from experiments import algos_parallel, builders  # pylint: disable=import-outside-toplevel
    from jaxcomm import parallel, train  # pylint: disable=import-outside-toplevel
    mesh = parallel.make_mesh(mesh_shape)
    layout = parallel.Layout(mesh, **options)
    cfg = dataclasses.replace(cfg, extra={"layout": layout})
    model, loss_fn, params, batch_fn, _ = builders.make_task(cfg)
    specs = layout.param_specs(model.param_axes(), params, max_replicated=1.0)
    tx = algos_parallel.layout_optimizer(cfg, layout, specs, model.param_regather())
    trainer = train.Trainer(loss_fn, tx, mesh, axis_name=layout.batch_axes, param_specs=specs)
    return mesh_shape, trainer, params, batch_fn(0)
  return build


layout("zero1")(_zero(1))
layout("zero2")(_zero(2))
layout("zero3")(_laid_out({"fsdp": 8}))
layout("tp")(_laid_out({"data": 2, "tensor": 4}))
layout("tp_sp")(_laid_out({"data": 2, "tensor": 4}, sequence_parallel=True))
layout("dp_fsdp_tp")(_laid_out({"data": 2, "fsdp": 2, "tensor": 2}))


def measure(name, cfg):
  """Compiles one step of layout `name`: bytes by axis and per-device memory."""
  from jaxcomm import comm  # pylint: disable=import-outside-toplevel
  mesh_shape, trainer, params, batch = LAYOUTS[name](cfg)
  state = trainer.init(params)
  batch = trainer.shard_batch(batch)
  compiled = trainer.step_fn(state, batch).lower(state, batch).compile()
  report = comm.parse_hlo(compiled.as_text(), mesh=trainer.mesh)
  memory = compiled.memory_analysis()
  by_axis = {",".join(k) or "?": v for k, v in report.by_axis().items()}
  return {"layout": name, "mesh": mesh_shape, "seq_len": cfg.seq_len,
          "wire_bytes_by_axis": by_axis, "wire_bytes": report.wire_bytes(),
          "temp_bytes": memory.temp_size_in_bytes,
          "argument_bytes": memory.argument_size_in_bytes}


def _table(rows) -> str:
  axes = ["data", "data,sequence", "sequence", "pipeline", "fsdp", "tensor"]
  head = (f"{'layout':<18}{'mesh':<16}{'T':>5}" + "".join(f"{a:>15}" for a in axes) +
          f"{'total':>12}{'temp KiB':>10}{'args KiB':>10}")
  out = [head, "-" * len(head)]
  for r in rows:
    mesh = "x".join(f"{k[0]}{v}" for k, v in r["mesh"].items())
    cells = "".join(f"{r['wire_bytes_by_axis'].get(a, 0):>15,.0f}" for a in axes)
    out.append(f"{r['layout']:<18}{mesh:<16}{r['seq_len']:>5}{cells}"
               f"{r['wire_bytes']:>12,.0f}{r['temp_bytes'] / 1024:>10,.0f}"
               f"{r['argument_bytes'] / 1024:>10,.0f}")
  return "\n".join(out)


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", 8)
  from experiments import builders  # pylint: disable=import-outside-toplevel

  names = _ONLY.value.split(",") if _ONLY.value else list(LAYOUTS)
  rows = []
  for seq_len in (int(t) for t in _SEQ_LENS.value.split(",")):
    cfg = builders.Config(model="lm", dataset="pydoc", batch_size=_BATCH.value,
                          seq_len=seq_len, d_model=_D_MODEL.value, num_layers=_LAYERS.value,
                          num_heads=_HEADS.value, d_ff=4 * _D_MODEL.value)
    for name in names:
      rows.append(measure(name, cfg))
      print(_table(rows[-1:]).splitlines()[-1], flush=True)
  print()
  print(f"LM d_model={_D_MODEL.value} layers={_LAYERS.value} heads={_HEADS.value} "
        f"batch={_BATCH.value}, AdamW, 8 emulated devices; wire bytes per device per step "
        f"from the compiled HLO, memory per device from XLA's memory analysis")
  print(_table(rows))
  if _OUT.value:
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  app.run(main)
