r"""Step-time overhead of every compressor over exact data parallelism.

  python -m benchmarks.overhead --config.model=lm,mlp --config.repeats=5 --config.steps=10
  python -m benchmarks.overhead --config.model=lm --config.methods="'DeMo 64/32'"  # vs DP
  python -m benchmarks.overhead --config.mesh=replica=2,fsdp=2,tensor=2  # sharded Muon, DP

For each model (the experiments' default LM; the MLP on digits) each method trains inside
the `Trainer` on a mesh of --devices devices (emulated CPU devices, or the accelerators
there are: on one GPU, --devices=1). After a compile and warm-up step, every repeat times
`steps` steps of every method in turn (round-robin, so drift from a shared machine hits all
methods alike); the table shows each method's median step time over the repeats divided by
exact DP's. On emulated CPU devices the collectives are memory copies: the ratio is the
compute overhead of encoding, decoding and the extra ops, not network time.

With `mesh` (a laid-out mesh such as replica=2,fsdp=2,tensor=2) the LM of `make run` is laid
out over it (experiments.build: ZeRO-3 over fsdp, Megatron over tensor) and the methods are
`SHARDED`: AdamW with exact DP over the replicas, and Muon (`sync.muon`) with its matrices
orthogonalised owner-based or by Gram all-reduces. The settings are `get_config()`'s
(`--help` lists them); `methods` is a tuple of names, each quoted where it holds a space or
a comma: `--config.methods="'PowerSGD rank 1','DeMo 64/32'"`.
"""

from __future__ import annotations

import statistics
import time

import jax
import ml_collections
import optax
from absl import flags

from experiments import _cli, build, config
from experiments import toolkit
from jaxcomm import codecs, sync, train

MODELS = ("lm", "mlp")


def get_config() -> ml_collections.ConfigDict:
  """The benchmark's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      model=MODELS,   # models timed
      repeats=5,      # timed repeats per method (the median is reported)
      steps=10,       # steps per timed repeat
      mesh="",        # a laid-out mesh (replica=2,fsdp=2,tensor=2): the SHARDED methods
      methods=()))    # only these methods (names as in the table; (): all); DP always runs


def methods():
  """(name, builder(inner) -> transform); 1-bit Adam and DeMo replace the inner optimiser."""
  key = jax.random.key(0)
  chain = lambda s: (lambda inner: optax.chain(s(), inner))
  return [
      ("exact DP", chain(sync.mean)),
      ("cast bf16 (two-phase)", chain(lambda: sync.compressed(codecs.cast("bfloat16")))),
      ("int8 + EF (two-phase)",
       chain(lambda: sync.compressed(codecs.uniform(8, block=256), memory="ef"))),
      ("top-k 1% + EF (gather)",
       chain(lambda: sync.compressed(codecs.top_k(0.01), memory="ef"))),
      ("QSGD 7 levels (two-phase)", chain(lambda: sync.compressed(codecs.qsgd(7), key=key))),
      ("sign + EF (two-phase)", chain(lambda: sync.compressed(codecs.sign(), memory="ef"))),
      ("PowerSGD rank 1", chain(lambda: sync.powersgd(1))),
      ("PowerSGD rank 4", chain(lambda: sync.powersgd(4))),
      ("LQ-SGD rank 4, 8-bit", chain(lambda: sync.lq_sgd(4, bits=8))),
      ("1-bit Adam after freeze", lambda inner: sync.onebit_adam(1e-3, freeze_step=0)),
      ("DeMo 64/32", lambda inner: sync.demo(1e-3)),
  ]


# name -> experiments.config method entry, for --mesh (the first is the ratios' reference).
SHARDED = {
    "AdamW, exact DP": {"method": "dp"},
    "Muon, owner-based": {"method": "muon", "strategy": "owner"},
    "Muon, Gram all-reduces": {"method": "muon", "strategy": "gram"},
}


def sharded_runs(mesh: str) -> list:
  """[name, trainer, state, batch, []] of every SHARDED method on the LM laid out on `mesh`."""
  runs = []
  for name, entry in SHARDED.items():
    c = config.with_method(config.base_config(), dict(entry, mesh=mesh))
    run = build.build(c)
    trainer = run.trainer()
    state = trainer.init(run.params)
    batch = run.batches(0)
    state, _ = time_steps(trainer, state, batch, 2)  # compile and warm up
    runs.append([name, trainer, state, batch, []])
  return runs


def task(model: str):
  """(loss_fn, params, batch, has_aux) for the model, one fixed global batch."""
  if model not in ("lm", "mlp"):
    raise ValueError(f"model must be one of 'lm', 'mlp'; got {model!r}.")
  c = config.base_config()  # the experiments' default LM; the digits MLP at batch 128
  if model == "mlp":
    c.model.name, c.data.name, c.data.batch_size = "mlp", "digits", 128
  _, loss_fn, has_aux, params, batches = build.model_task(c)
  return loss_fn, params, batches(0), has_aux


def time_steps(trainer, state, batch, steps):
  start = time.perf_counter()
  for _ in range(steps):
    state, m = trainer.step(state, batch)
  jax.block_until_ready((state, m))
  return state, (time.perf_counter() - start) / steps


def selected(names=()) -> list:
  """`methods()`, only `names` where given (exact DP always first: the ratios' reference);
  an unknown name is a ValueError naming config.methods and the allowed names."""
  chosen = methods()
  known = [name for name, _ in chosen]
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise ValueError(f"config.methods: unknown {unknown}; allowed: {known}.")
  return [m for m in chosen if not names or m[0] == "exact DP" or m[0] in names]


def check(c) -> list:
  """The settings, checked (ValueError naming the first out of range); the methods chosen."""
  for name in {"repeats", "steps"} & set(c.keys()):
    toolkit.int_at_least(c, name, 1)
  if not c.model or set(c.model) - set(MODELS):
    raise ValueError(f"config.model must name models out of {', '.join(MODELS)}, got "
                     f"{c.model!r}.")
  return selected(c.methods)


def main(argv):
  del argv
  c = flags.FLAGS.config
  jax.config.update("jax_num_cpu_devices", flags.FLAGS.devices)  # before methods() runs JAX
  chosen = check(c)
  devices = min(flags.FLAGS.devices, jax.device_count())
  mesh = train.make_mesh({"data": devices})
  where = f" on {c.mesh}" if c.mesh else ""
  print(f"{jax.devices()[0].platform} x {devices} devices{where}; median of {c.repeats} "
        f"repeats of {c.steps} steps; ratio = step time / exact DP step time")
  results = {}
  for model in (["lm"] if c.mesh else c.model):
    runs = sharded_runs(c.mesh) if c.mesh else []
    if not c.mesh:
      loss_fn, params, batch, has_aux = task(model)
    for name, make in ([] if c.mesh else chosen):
      trainer = train.Trainer(loss_fn, make(optax.adam(1e-3)), mesh, has_aux=has_aux)
      state = trainer.init(params)
      batch_d = trainer.shard_batch(batch) if jax.process_count() > 1 else batch
      state, _ = time_steps(trainer, state, batch_d, 2)  # compile and warm up
      runs.append([name, trainer, state, batch_d, []])
    for _ in range(c.repeats):
      for run in runs:
        run[2], seconds = time_steps(run[1], run[2], run[3], c.steps)
        run[4].append(seconds)
    base = statistics.median(runs[0][4])
    results[model] = {run[0]: (statistics.median(run[4]), statistics.median(run[4]) / base)
                      for run in runs}
  models = list(results)
  head = f"{'method':28s}" + "".join(f" | {m + ' ms':>10s} {'ratio':>6s}" for m in models)
  print(head)
  print("-" * len(head))
  for name in (list(SHARDED) if c.mesh else [n for n, _ in chosen]):
    print(f"{name:28s}" + "".join(
        f" | {1e3 * results[m][name][0]:>10.2f} {results[m][name][1]:>5.2f}x" for m in models))


if __name__ == "__main__":
  _cli.run(main, get_config(), devices=8)
