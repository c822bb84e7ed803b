r"""Wire bytes per step by mesh axis and compiled memory per device, for each LM layout.

  python -m benchmarks.layouts --config.seq_lens=64,256 --out=runs/layouts.json

Every layout trains the same transformer LM (one training step: forward, backward,
gradient mean, AdamW) on 8 emulated CPU devices. For each layout and sequence length the
step is compiled once and read, not timed: `comm.inspect` gives the bytes each device puts
on the wire per mesh axis (every collective of the optimised program), and the compiled
program's memory analysis gives the per-device bytes of temporaries and of arguments
(parameters, optimiser state and the batch shard).

Each layout is a few config overrides (`LAYOUTS`) of one base run, built by
experiments/build.py like every other run. The settings are `get_config()`'s (`--help`
lists them).
"""

from __future__ import annotations


import jax
import ml_collections
from absl import flags

from experiments import _cli, build, config
from experiments import toolkit
from jaxcomm import comm


def get_config() -> ml_collections.ConfigDict:
  """The benchmark's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      seq_lens=(64, 256),                    # sequence lengths
      batch_size=16,                         # global batch
      d_model=64, num_layers=4, num_heads=4,  # layers divisible by the pipeline axis, heads
                                             # by the sequence axis; the MLP 4 x d_model
      only=""))                              # comma-separated layout names ("": all)

# layout -> config overrides (experiments/config.py paths) of the base run.
LAYOUTS: dict[str, dict] = {
    "dp": {"mesh": "data=8"},
    **{kind: {"mesh": "data=2,sequence=4", "model.attention": kind}
       for kind in ("ring", "ring_zigzag", "ulysses", "linear_lasp2", "linear_allscan",
                    "linear_lasp_ring")},
    # M = S and M = 2S: GPipe's activations grow with M, 1F1B's do not.
    **{f"{schedule}_m{micro}": {"mesh": "data=2,pipeline=4", "model.schedule": schedule,
                                "model.microbatches": micro}
       for micro in (4, 8) for schedule in ("gpipe", "1f1b")},
    "zero1": {"method": "zero", "method.stage": 1},
    "zero2": {"method": "zero", "method.stage": 2},
    "zero3": {"mesh": "fsdp=8"},
    "tp": {"mesh": "data=2,tensor=4"},
    "tp_sp": {"mesh": "data=2,tensor=4", "model.sequence_parallel": True},
    "dp_fsdp_tp": {"mesh": "data=2,fsdp=2,tensor=2"},
}


def layout_config(name: str, base):
  """The base config with layout `name`'s overrides."""
  c = base.copy_and_resolve_references()
  overrides = dict(LAYOUTS[name])
  if "method" in overrides:
    c = config.with_method(c, {"method": overrides.pop("method")})
  for path, value in overrides.items():
    *parents, leaf = path.split(".")
    node = c
    for part in parents:
      node = node[part]
    node[leaf] = value
  return c


def measure(name, base):
  """Compiles one step of layout `name`: bytes by axis and per-device memory."""
  run = build.build(layout_config(name, base))
  trainer = run.trainer()
  state = trainer.init(run.params)
  batch = trainer.shard_batch(run.batches(0))
  compiled = trainer.step_fn(state, batch).lower(state, batch).compile()
  report = comm.parse_hlo(compiled.as_text(), mesh=trainer.mesh)
  memory = compiled.memory_analysis()
  by_axis = {",".join(k) or "?": v for k, v in report.by_axis().items()}
  return {"layout": name, "mesh": dict(run.mesh.shape), "seq_len": base.data.seq_len,
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
  c = flags.FLAGS.config
  seq_lens = toolkit.values_at_least(c, "seq_lens", 1)
  names = toolkit.names_in(c, "only", list(LAYOUTS))
  jax.config.update("jax_num_cpu_devices", 8)

  rows = []
  for seq_len in seq_lens:
    base = config.base_config("dp")
    base.data.update(batch_size=c.batch_size, seq_len=seq_len)
    base.model.update(d_model=c.d_model, num_layers=c.num_layers, num_heads=c.num_heads,
                      d_ff=4 * c.d_model)
    config.check(base)  # a size out of range: one line naming it
    for name in names:
      rows.append(measure(name, base))
      print(_table(rows[-1:]).splitlines()[-1], flush=True)
  print()
  print(f"LM d_model={c.d_model} layers={c.num_layers} heads={c.num_heads} "
        f"batch={c.batch_size}, AdamW, 8 emulated devices; wire bytes per device per step "
        f"from the compiled HLO, memory per device from XLA's memory analysis")
  print(_table(rows))
  _cli.write_json(flags.FLAGS.out, rows)


if __name__ == "__main__":
  _cli.run(main, get_config(), out=True)
