r"""XLA:CPU compile time of jaxcomm's programs under the test suite's XLA flags and without them.

  python -m benchmarks.xla_compile_flags --config.repeats=2

The suite (tests/conftest.py) mostly compiles small programs that run a few steps, so its time
is compile time. XLA reads its flags once, when the backend starts, so each variant runs in a
process of its own: a training step of the MLP on digits on 8 emulated devices under exact DP,
DiLoCo and PowerSGD, one of a small transformer LM under exact DP, and 59 rounds of eager ops
on arrays of new shapes (each op a program of its own, as in a test's reference code). A child
reports the CPU seconds of each program's first step (trace, compile and one run) and its
median step time after; the variants take turns, `repeats` times, so that a machine's drift
hits them alike. Prints each variant's median and its ratio to the first (XLA's defaults).
All variants run with `JAX_DISABLE_MOST_OPTIMIZATIONS=1`, as the suite does.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import ml_collections
from absl import flags

from experiments import _cli

DEVICES = "--xla_force_host_platform_device_count=8"
# name: XLA flags beyond the 8 devices. The last is tests/conftest.py's default.
VARIANTS = {
    "XLA defaults": "",
    "no Eigen pool": "--xla_cpu_multi_thread_eigen=false",
    "+ loop emitters": "--xla_cpu_multi_thread_eigen=false --xla_cpu_use_fusion_emitters=false",
    "+ one LLVM module": ("--xla_cpu_multi_thread_eigen=false --xla_cpu_use_fusion_emitters=false"
                          " --xla_cpu_parallel_codegen_split_count=1"),
}
PROGRAMS = ("dp", "diloco", "powersgd", "lm_dp")


def get_config() -> ml_collections.ConfigDict:
  """The benchmark's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      repeats=2,      # rounds over the variants
      steps=10,       # steps timed after each program's first
      child=False))   # internal: measure in this process (XLA_FLAGS already set)


def _measure(steps: int) -> dict:
  """{program: [first-step CPU s, median step ms]} and {"eager": CPU s} in this process."""
  # Imported here: the parent only starts the children, so it never loads JAX.
  import jax
  import jax.numpy as jnp
  import optax

  from jaxcomm import data, local, models, sync, train

  mlp = models.MLP(hidden=(16,), num_classes=10)
  params = mlp.init(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(mlp)(p, b)[0]
  batch = data.digits().batch(0, 32)
  lm = models.TransformerLM(d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=16)
  lm_params = jax.jit(lm.init)(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  tokens = {"tokens": jnp.zeros((16, 17), jnp.int32)}
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  setups = {
      "dp": (loss, params, batch, optax.chain(sync.mean("data"), optax.sgd(0.1))),
      "diloco": (loss, params, batch, local.diloco(optax.adam(1e-3), outer, 4, "data")),
      "powersgd": (loss, params, batch,
                   optax.chain(sync.powersgd(2, axis_name="data"), optax.sgd(0.1))),
      "lm_dp": (models.lm_loss(lm), lm_params, tokens,
                optax.chain(sync.mean("data"), optax.adamw(1e-3))),
  }
  mesh = train.make_mesh({"data": 8})
  out = {}
  for name in PROGRAMS:
    loss_fn, p, b, tx = setups[name]
    trainer = train.Trainer(loss_fn, tx, mesh, batch_axes="data")
    state, b = trainer.init(p), trainer.shard_batch(b)
    start = time.process_time()
    state, m = trainer.step(state, b)
    jax.block_until_ready(m)
    first = time.process_time() - start
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      state, m = trainer.step(state, b)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - start)
    out[name] = [first, 1e3 * statistics.median(times)]
  start = time.process_time()
  for n in range(1, 60):
    x = jnp.ones((n, 3))
    jax.block_until_ready((x * 2 + 1).sum(0) @ jnp.ones((3,)))
  out["eager"] = [time.process_time() - start, 0.0]
  return out


def _child(variant: str, steps: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"{DEVICES} {VARIANTS[variant]}".strip(),
             JAX_DISABLE_MOST_OPTIMIZATIONS="1", JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every variant compiles afresh
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.xla_compile_flags", "--config.child=True",
       f"--config.steps={steps}"], env=env, capture_output=True, text=True, check=True)
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  c = flags.FLAGS.config
  if c.child:
    print(json.dumps(_measure(c.steps)))
    return
  runs = {v: [] for v in VARIANTS}
  for _ in range(c.repeats):
    for variant in VARIANTS:
      runs[variant].append(_child(variant, c.steps))
  base = next(iter(VARIANTS))
  med = {v: {p: [statistics.median(r[p][i] for r in runs[v]) for i in (0, 1)]
             for p in (*PROGRAMS, "eager")} for v in VARIANTS}
  for v in med:
    med[v]["all"] = [sum(med[v][p][0] for p in (*PROGRAMS, "eager")), 0.0]
  print("first step (trace + compile + run), CPU seconds; in brackets: over XLA's defaults")
  print(f"{'variant':<20}" + "".join(f"{p:>16}" for p in (*PROGRAMS, "eager", "all")))
  for v in VARIANTS:
    print(f"{v:<20}" + "".join(
        f"{med[v][p][0]:>8.2f} ({med[v][p][0] / med[base][p][0]:.2f})"
        for p in (*PROGRAMS, "eager", "all")))
  print("\nstep time after, median ms (over XLA's defaults)")
  print(f"{'variant':<20}" + "".join(f"{p:>16}" for p in PROGRAMS))
  for v in VARIANTS:
    print(f"{v:<20}" + "".join(
        f"{med[v][p][1]:>8.2f} ({med[v][p][1] / med[base][p][1]:.2f})" for p in PROGRAMS))


if __name__ == "__main__":
  _cli.run(main, get_config())
