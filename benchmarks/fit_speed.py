r"""Steps per second of the training loop, reading the devices every step or at log steps.

  python -m benchmarks.fit_speed --config.steps=40 --config.repeats=3 --devices=8

The LM of `make run` (d_model 64, 2 layers, 4 heads, d_ff 256, batch 32, sequence 64) with
exact data parallelism and AdamW on --devices devices, trained by two loops over the same
compiled step, alternated `repeats` times (so drift on a shared machine hits both alike):

* `every step`, the loop `fit` ran before: `Trainer.step` (the step, then the measurement
  program) and `int(np.asarray(m["wire_bytes"]))` every step, the loss at log steps;
* `log steps`, `train.fit` now: `Trainer.dispatch` only; bytes and losses stay on the
  devices until a log step reads them.

Then each loop runs `profile_steps` steps under the JAX profiler, and the table gives the
*dispatch gap*: the time between the last instruction of one execution of the step program
and the first instruction of the next, on any device (the devices are all idle meanwhile),
median over the steps. On emulated CPU devices the Trainer still waits for every step before
dispatching the next (`Trainer.dispatch`: XLA:CPU collectives deadlock when two executions
overlap), so the gap is the host's work between steps: reading back, the measurement
program, the next batch, the dispatch. On an accelerator nothing waits and the gain of not
reading back is larger.
"""

from __future__ import annotations

import glob
import gzip
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import ml_collections
import optax
from absl import flags

from benchmarks import profile_step
from experiments import _cli
from experiments import toolkit
from jaxcomm import data, models, sync, train


def get_config() -> ml_collections.ConfigDict:
  """The benchmark's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      steps=10,           # steps per timed repeat
      repeats=5,          # timed repeats of each loop (the median is reported)
      log_every=10,       # log every this many steps (both loops)
      profile_steps=10))  # steps traced per loop

LM = dict(d_model=64, num_layers=2, num_heads=4, d_ff=256, max_len=64)
BATCH, SEQ = 32, 64


def every_step_loop(trainer, state, batch_fn, steps: int, log_every: int):
  """The loop before: every step's measurements built and its byte count read back."""
  total, first = 0, int(np.asarray(state.step))
  for t in range(first, first + steps):
    state, m = trainer.step(state, trainer.shard_batch(batch_fn(t)))
    total += int(np.asarray(m["wire_bytes"]))
    if (t + 1) % log_every == 0:
      float(np.asarray(m["loss"]))
  return state


def log_step_loop(trainer, state, batch_fn, steps: int, log_every: int):
  """`train.fit`: the devices are read at log steps only."""
  end = int(np.asarray(state.step)) + steps
  return train.fit(trainer, state, batch_fn, end, log_every=log_every, progress=False)[0]


LOOPS = {"every step": every_step_loop, "log steps": log_step_loop}


def dispatch_gaps(trace: dict, ops: dict) -> list[float]:
  """Seconds between consecutive executions of the step program, all devices idle.

  Executions are delimited by the host's launch events of the step program on device 0;
  the instructions run between two launches belong to the earlier execution.
  """
  launches = sorted(e["ts"] for e in trace["traceEvents"] if e.get("ph") == "X"
                    and e["name"].startswith("[0] ") and "(jit_step_local)" in e["name"])
  spans = [(e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
           if e.get("ph") == "X" and e["name"] in ops
           and profile_step.category(ops[e["name"]]) is not None]
  gaps = []
  for before, after in zip(launches[1:], launches[2:] + [float("inf")]):
    ended = [end for start, end in spans if start < before]
    started = [start for start, _ in spans if before <= start < after]
    if ended and started:
      gaps.append((min(started) - max(ended)) * 1e-6)
  return gaps


def profile(loop, trainer, state, batch_fn, steps: int, log_every: int):
  """(state, dispatch gaps) of `steps` steps of `loop` under the profiler."""
  probe = trainer.shard_batch(batch_fn(0))
  compiled = lambda fn, *args: profile_step.instruction_ops(fn.lower(*args).compile().as_text())
  ops = compiled(trainer.step_fn(state, probe), state, probe)
  # Trace events name instructions, not programs: keep the names only the step program has
  # (the measurement program's fusions are named alike).
  # The step donates its state: go on from the state this probe step returns.
  state, per_device, sent = trainer.dispatch(state, probe)
  for name in compiled(jax.jit(trainer.measurements), per_device, sent):
    ops.pop(name, None)
  with tempfile.TemporaryDirectory() as workdir:
    with jax.profiler.trace(workdir):
      state = jax.block_until_ready(loop(trainer, state, batch_fn, steps, log_every))
    path, = glob.glob(f"{workdir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
      trace = json.load(f)
  return state, dispatch_gaps(trace, ops)


def main(argv):
  del argv
  c = flags.FLAGS.config
  for name in ("steps", "repeats", "log_every", "profile_steps"):
    toolkit.int_at_least(c, name, 1)
  jax.config.update("jax_num_cpu_devices", flags.FLAGS.devices)
  devices = min(flags.FLAGS.devices, jax.device_count())
  mesh = train.make_mesh({"data": devices})
  lm = models.TransformerLM(**LM)
  params = jax.jit(lm.init)(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
  trainer = train.Trainer(models.lm_loss(lm), optax.chain(sync.mean("data"),
                                                          optax.adamw(3e-3)), mesh)
  corpus = data.pydoc_text()
  batch_fn = lambda t: corpus.batch(t, BATCH, seq_len=SEQ)
  state = every_step_loop(trainer, trainer.init(params), batch_fn, 2, 1)  # compile
  state = log_step_loop(trainer, state, batch_fn, 2, 1)
  seconds = {name: [] for name in LOOPS}
  for _ in range(c.repeats):
    for name, loop in LOOPS.items():
      start = time.perf_counter()
      state = jax.block_until_ready(loop(trainer, state, batch_fn, c.steps, c.log_every))
      seconds[name].append(time.perf_counter() - start)
  gaps = {}
  for name, loop in LOOPS.items():
    state, gaps[name] = profile(loop, trainer, state, batch_fn, c.profile_steps, c.log_every)
  print(f"{jax.devices()[0].platform} x {devices} devices; median of {c.repeats} "
        f"repeats of {c.steps} steps, log every {c.log_every}; dispatch gap: "
        f"median over {c.profile_steps} traced steps")
  base = statistics.median(seconds["every step"])
  print(f"{'loop':12s} {'steps/s':>9s} {'speed-up':>9s} {'dispatch gap ms':>16s}")
  for name in LOOPS:
    rate = c.steps / statistics.median(seconds[name])
    speedup = base / statistics.median(seconds[name])
    gap = 1e3 * statistics.median(gaps[name]) if gaps[name] else float("nan")
    print(f"{name:12s} {rate:9.2f} {speedup:8.2f}x {gap:16.2f}")


if __name__ == "__main__":
  _cli.run(main, get_config(), devices=8)
