r"""Where a compressor's step time goes: kernels, library calls, collectives, host.

  python -m benchmarks.profile_step --config.model=mlp,lm --config.steps=10
  python -m benchmarks.profile_step --config.model=mlp --config.methods="'PowerSGD rank 4'"

For each method of `benchmarks.overhead` (same models, same Trainer), traces `steps` steps
with the JAX profiler and attributes every executed HLO instruction (a "thunk" on CPU, a
kernel on GPU) to one of:

* `kernels`: fusions, dots, copies, element-wise ops: the arithmetic of the model and of
  encoding and decoding;
* `library`: custom calls and sorts (LAPACK QR for PowerSGD, top-k): opaque calls that do
  not fuse;
* `collective`: all-reduce, all-gather, all-to-all, reduce-scatter, permutes, including the
  time a device waits in the rendezvous for the others;
* `host`: the rest of the wall time: dispatch, thread hand-offs, waiting for a core.

Times are per step and per device (the mean over device threads of each category's total),
so the four columns add up to the step time where devices run in parallel; on 8 emulated
devices sharing 2 cores they run interleaved and the rendezvous waits absorb the
difference. `n` is the number of instructions executed per step (loops counted per trip).
The second table is each method's excess over exact DP, split the same way: it says which
part of a compressor's overhead is its arithmetic, which its library calls and which its
extra collectives.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax
import ml_collections
import optax
from absl import flags

from benchmarks import overhead
from experiments import _cli
from jaxcomm import train


def get_config() -> ml_collections.ConfigDict:
  """The benchmark's settings (`--config.<name>=<value>`): benchmarks.overhead's models and
  methods (a tuple of names, (): all), and the steps traced per method."""
  c = overhead.get_config()
  del c.repeats, c.mesh
  return c

CATEGORIES = ("kernels", "library", "collective")
_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter",
                "collective-permute")
# Instructions whose trace events enclose other instructions' events (not counted twice).
_CONTAINERS = ("while", "conditional", "call")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\(")


def category(op: str) -> str | None:
  """The category of an HLO opcode, None for the ones that only contain others."""
  base = op.removesuffix("-start").removesuffix("-done")
  if base in _COLLECTIVES:
    return "collective"
  if op in ("custom-call", "sort"):
    return "library"
  if op in _CONTAINERS:
    return None
  return "kernels"


def instruction_ops(hlo: str) -> dict:
  """{instruction name: opcode} of every instruction in an HLO module's text."""
  ops = {}
  for line in hlo.splitlines():
    m = _INSTR.match(line)
    if m:
      ops[m.group(1)] = m.group(2)
  return ops


def attribute(trace: dict, ops: dict, runs: int) -> dict:
  """Seconds per category and instructions executed, per run of the program on one device,
  from a trace of `runs` runs on every device (`runs` = steps x devices)."""
  seconds = collections.Counter()
  count = 0
  for e in trace["traceEvents"]:
    if e.get("ph") != "X" or e["name"] not in ops:
      continue
    kind = category(ops[e["name"]])
    if kind is not None:
      seconds[kind] += e["dur"] * 1e-6
      count += 1
  return {**{k: seconds[k] / runs for k in CATEGORIES}, "n": count / runs}


def profile(trainer, state, batch, steps: int) -> dict:
  """Traces `steps` runs of the compiled step; returns the attribution plus the wall seconds
  per step. The step program alone is timed, one step at a time as `Trainer.step` runs it
  on CPU, without the Trainer's host-side measurement post-processing (the same for every
  method)."""
  fn = trainer.step_fn(state, batch)
  hlo = fn.lower(state, batch).compile().as_text()
  for _ in range(2):  # compile and warm up outside the trace
    state = jax.block_until_ready(fn(state, batch)[0])
  with tempfile.TemporaryDirectory() as workdir:
    with jax.profiler.trace(workdir, create_perfetto_trace=True):
      start = time.perf_counter()
      for _ in range(steps):
        state = jax.block_until_ready(fn(state, batch)[0])
      wall = (time.perf_counter() - start) / steps
    path, = glob.glob(f"{workdir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
      trace = json.load(f)
  result = attribute(trace, instruction_ops(hlo), steps * trainer.mesh.size)
  result["step"] = wall
  result["host"] = max(0.0, wall - sum(result[k] for k in CATEGORIES))
  return result


def table(rows: dict) -> str:
  """The per-method breakdown and each method's excess over the first (exact DP), in ms."""
  cols = ("step",) + CATEGORIES + ("host",)
  head = f"{'method':28s} {'n':>6s}" + "".join(f" {c + ' ms':>13s}" for c in cols)
  lines = [head, "-" * len(head)]
  for name, r in rows.items():
    lines.append(f"{name:28s} {r['n']:6.0f}" + "".join(f" {1e3 * r[c]:13.3f}" for c in cols))
  base = next(iter(rows.values()))
  lines += ["", f"{'excess over ' + next(iter(rows)):28s} {'n':>6s}"
            + "".join(f" {c + ' ms':>13s}" for c in cols), "-" * len(head)]
  for name, r in list(rows.items())[1:]:
    lines.append(f"{name:28s} {r['n'] - base['n']:+6.0f}"
                 + "".join(f" {1e3 * (r[c] - base[c]):+13.3f}" for c in cols))
  return "\n".join(lines)


def main(argv):
  del argv
  c = flags.FLAGS.config
  jax.config.update("jax_num_cpu_devices", flags.FLAGS.devices)  # before methods() runs JAX
  known = dict(overhead.check(c))  # exact DP first: the second table's reference
  devices = min(flags.FLAGS.devices, jax.device_count())
  mesh = train.make_mesh({"data": devices})
  names = list(known)
  print(f"{jax.devices()[0].platform} x {devices} devices; {c.steps} traced steps; "
        "ms per step and device")
  for model in c.model:
    loss_fn, params, batch, has_aux = overhead.task(model)
    rows = {}
    for name in names:
      trainer = train.Trainer(loss_fn, known[name](optax.adam(1e-3)), mesh, has_aux=has_aux)
      rows[name] = profile(trainer, trainer.init(params), batch, c.steps)
    print(f"\n== {model}\n{table(rows)}")


if __name__ == "__main__":
  _cli.run(main, get_config(), devices=8)
