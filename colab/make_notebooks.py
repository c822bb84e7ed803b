"""Writes the notebooks of colab/ from the cell sources below (outputs cleared).

Run from the repository root: `python colab/make_notebooks.py`. Edit the cells here, not the
.ipynb files, so that the notebooks stay reviewable as code.
"""

import pathlib

import nbformat

HERE = pathlib.Path(__file__).resolve().parent

SETUP = '''\
# Setup: install jaxcomm where it is missing, then take 8 devices.
import glob, importlib, importlib.util, os, subprocess, sys
# JAXCOMM_PIP (a wheel's path or URL, or git+https://... of a fork), else an uploaded wheel.
wheels = sorted(glob.glob("jaxcomm-*.whl") + glob.glob("/content/jaxcomm-*.whl"))
source = os.environ.get("JAXCOMM_PIP") or (wheels[-1] if wheels else None)
if os.environ.get("JAXCOMM_PIP") or importlib.util.find_spec("jaxcomm") is None:
  if source is None:
    raise RuntimeError("jaxcomm is not installed: upload dist/jaxcomm-*.whl in the Files pane "
                       "or set JAXCOMM_PIP (see the cell above), then run this cell again.")
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", source], check=True)
  importlib.invalidate_caches()
import jax
# Emulated CPU devices are set up before anything touches a backend (CPU only is affected).
jax.config.update("jax_num_cpu_devices", 8)
if jax.device_count() >= 8:  # a TPU v2-8 / v3-8 runtime, a host of 8 GPUs: the real devices
  DEVICES = jax.devices()
else:  # a 1-GPU or 1-chip runtime, or CPU: the notebook's 8-device meshes on emulated CPUs
  print(f"{jax.device_count()} {jax.devices()[0].platform} device(s), fewer than 8: using "
        "8 emulated CPU devices")
  DEVICES = jax.devices("cpu")
import jaxcomm
print(len(DEVICES), "devices:", DEVICES[0].platform, "| jaxcomm", jaxcomm.__version__,
      "from", os.path.dirname(jaxcomm.__file__))'''

SETUP_MD = """\
**Setup.** The next cell installs jaxcomm when it is not installed yet. On Colab, either

* upload the wheel: in a checkout run `pip wheel --no-deps -w dist .` (or
  `python -m build --wheel`), then drag `dist/jaxcomm-<version>-py3-none-any.whl` into the
  Files pane (it lands in `/content`, where the cell looks); or
* set a pip requirement before the cell: `%env JAXCOMM_PIP=<wheel path or URL>` (a
  `git+https://...` URL of your fork works too).

pip installs jaxcomm's dependencies with it (it may replace the runtime's jax with the
version jaxcomm pins; restart the runtime if Colab asks). Locally, with jaxcomm installed or
the checkout on `PYTHONPATH`, the cell installs nothing.

**Devices.** The cell takes the runtime's accelerators when there are at least 8 (a TPU
v2-8 or v3-8 runtime, 8 GPUs) and otherwise 8 emulated CPU devices (a 1-GPU or 1-chip
runtime: the meshes below need 8 devices). {devices}"""

# Which cells need how many devices, said at the top of each notebook.
DEVICE_NOTES = {
    "01_quickstart.ipynb":
        "The setup and parameter cells need none; the training, `comm.inspect` and config "
        "cells run on a `data=8` mesh: 8 devices.",
    "02_compression.ipynb":
        "The training cell runs every codec on a `data=8` mesh: 8 devices; the plot needs "
        "none.",
    "03_local_updates.ipynb":
        "DiLoCo, Streaming DiLoCo and data parallelism train on a `data=8` mesh, and so does "
        "the NNX model of the last part: 8 devices; the WAN clock is simulated on the host.",
    "04_layouts.ipynb":
        "Part 1 uses a `data=2 x tensor=4` mesh (8 devices) and its one-device reference on "
        "the first of them; part 2 lays the LM out over 8 devices in each layout; part 3 "
        "uses a `data=2 x sequence=4` mesh (8 devices).",
    "05_gossip_heterogeneous.ipynb":
        "D-PSGD and data parallelism train 8 workers on a `data=8` mesh, and the "
        "heterogeneous-workers simulation runs its 8 workers on the same mesh: 8 devices.",
}

PARAMS = '''\
# Parameters (the notebook test sets JAXCOMM_NB_STEPS to a small number).
import os
STEPS = int(os.environ.get("JAXCOMM_NB_STEPS", "{steps}"))'''


def md(text):
  return nbformat.v4.new_markdown_cell(text)


def code(text):
  return nbformat.v4.new_code_cell(text)


QUICKSTART = [
    md("# jaxcomm quickstart\n\nA mesh of 8 workers, an exact and a compressed (top-k "
       "with error feedback) data-parallel optimiser in `optax.chain`, a short training run, and "
       "the bytes each one puts on the wire: counted in the optimiser state where they are "
       "sent, and read back from the compiled program with `comm.inspect`."),
    code(SETUP),
    code(PARAMS.format(steps=200)),
    code('''\
import jax.numpy as jnp, numpy as np, optax
import matplotlib.pyplot as plt
from jaxcomm import codecs, comm, data, models, sync, train

mesh = train.make_mesh({"data": 8}, devices=DEVICES[:8])
# A grain pipeline: batches[step] is (this process's share of) global batch number `step`,
# a pure function of (seed, step), so a resumed run needs only the step.
batches = data.batches("digits", 256, seed=0)
model = models.MLP(hidden=(64,), num_classes=10)
params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
loss_fn = models.classifier_loss(model)'''),
    md("Two optimisers that differ only in what travels: `sync.mean` averages the local "
       "gradients exactly in f32; `sync.compressed(codecs.top_k(0.05), memory=\"ef\")` "
       "sends each worker's 5% largest gradient entries (values and indices) and keeps what "
       "it did not send in a per-worker error memory."),
    code('''\
optimisers = {
    "exact f32": optax.chain(sync.mean("data"), optax.adam(3e-3)),
    "top-k 5% + EF": optax.chain(sync.compressed(codecs.top_k(0.05), memory="ef",
                                                 axis_name="data"), optax.adam(3e-3)),
}
from tqdm import trange
runs = {}
for name, tx in optimisers.items():
  trainer = train.Trainer(loss_fn, tx, mesh, batch_axes="data", has_aux=True)
  state = trainer.init(params)
  losses, sent = [], []
  for step in trange(STEPS, desc=name):
    batch = trainer.shard_batch(batches[step])
    state, m = trainer.step(state, batch)
    losses.append(float(m["loss"]))
    sent.append(int(m["wire_bytes"]))
  runs[name] = dict(trainer=trainer, state=state, batch=batch, losses=losses, sent=sent)
  print(f"{name:14s} loss {losses[-1]:.3f}  wire bytes/step {sent[-1]:,}")'''),
    code('''\
fig, ax = plt.subplots(figsize=(5, 3))
for name, r in runs.items():
  ax.plot(r["losses"], label=name)
ax.set_xlabel("step"); ax.set_ylabel("training loss"); ax.set_yscale("log"); ax.legend()
plt.show()'''),
    md("The same bytes, read from the optimised HLO of the compiled step, and what they cost "
       "on a wide-area link (alpha-beta model, `comm.cost`)."),
    code('''\
for name, r in runs.items():
  report = comm.inspect(r["trainer"].step_fn(r["state"], r["batch"]), r["state"], r["batch"])
  print(name); print(report)
  costed = comm.cost(report, {"data": "wan"})
  print(f"counted {r['sent'][-1]:,} B/step, inspect {report.wire_bytes():,.0f} B/step, "
        f"{costed.seconds() * 1e3:.2f} ms/step on a WAN\\n")'''),
    md("The same run from an experiment config (`experiments/configs/`): every setting in one "
       "typed tree, each method's defaults read from its library factory, and one function, "
       "`build`, from the config to the model, batches, optimiser and mesh. "
       "`jaxcomm train --config=compressed` runs it from the command line (in a checkout, "
       "`python -m experiments.train --config=experiments/configs/compressed.py`)."),
    code('''\
from jaxcomm.experiments import build, config   # experiments/ of the repository, installed
c = config.base_config("compressed", codec="top_k:fraction=0.01", memory="ef")
c.model.name, c.data.name, c.steps = "mlp", "digits", STEPS
print(c.method)                         # the method's settings, defaults from sync.compressed
run = build.build(c, devices=DEVICES[:8])
program = run.program()                 # what train.fit takes: init, step, layout, ...
state, history = train.fit(program, program.init(run.params), run.batches, STEPS,
                           log_every=max(STEPS // 4, 1))
print(history[-1]["loss"], history[-1]["wire_bytes"])'''),
]

GOSSIP = [
    md("# Gossip and heterogeneous workers\n\nDecentralised SGD (D-PSGD) on a ring: each "
       "worker averages its parameters with its two neighbours instead of all-reducing "
       "gradients. We compare it with exact data parallelism (loss, bytes per step, "
       "consensus distance), then simulate workers of unequal speed with "
       "`sim.simulate_workers`."),
    code(SETUP),
    code(PARAMS.format(steps=200)),
    code('''\
import jax.numpy as jnp, numpy as np, optax
import matplotlib.pyplot as plt
from jaxcomm import data, models, sim, sync, train

mesh = train.make_mesh({"data": 8}, devices=DEVICES[:8])
digits = data.digits()
model = models.MLP(hidden=(64,), num_classes=10)
params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
loss_fn = models.classifier_loss(model)
optimisers = {
    "DP (all-reduce)": optax.chain(sync.mean("data"), optax.sgd(0.3)),
    "D-PSGD ring": sync.dpsgd(optax.sgd(0.3), "ring", num_workers=8, measure_consensus=True),
    "D-PSGD exponential": sync.dpsgd(optax.sgd(0.3), "exponential", num_workers=8,
                                     measure_consensus=True),
}'''),
    code('''\
runs = {}
for name, tx in optimisers.items():
  trainer = train.Trainer(loss_fn, tx, mesh, batch_axes="data", has_aux=True)
  state = trainer.init(params)
  losses, sent, consensus = [], [], []
  for step in range(STEPS):
    state, m = trainer.step(state, trainer.shard_batch(digits.batch(step, 256)))
    losses.append(float(m["loss"])); sent.append(int(m["wire_bytes"]))
    if isinstance(state.opt_state, sync.DpsgdState):
      consensus.append(float(state.opt_state.consensus_distance))
  runs[name] = dict(losses=losses, sent=sent, consensus=consensus)
  print(f"{name:20s} loss {losses[-1]:.3f}  wire bytes/step {sent[-1]:,}")'''),
    code('''\
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3))
for i, (name, r) in enumerate(runs.items()):
  a.plot(r["losses"], label=name, color=f"C{i}")
  if r["consensus"]:
    b.plot(r["consensus"], label=name, color=f"C{i}")
a.set_xlabel("step"); a.set_ylabel("training loss (mean over workers)"); a.legend()
b.set_xlabel("step"); b.set_ylabel("consensus distance"); b.set_yscale("log"); b.legend()
plt.tight_layout(); plt.show()'''),
    md("The bytes per step above include the consensus measurement (one extra all-reduce "
       "of the parameters). \n\n## Heterogeneous workers\n\nOn a noisy quadratic, seven "
       "workers take about 1 s per gradient and one takes about 10 s. Synchronous SGD waits "
       "for the slowest every step; asynchronous SGD and Rennala SGD do not."),
    code('''\
target = jnp.arange(4.0)
grad_fn = lambda p, key: (p - target) + 0.3 * jax.random.normal(key, p.shape)
loss_fn_q = lambda p: 0.5 * jnp.sum((p - target) ** 2)
compute = sim.lognormal([1.0] * 7 + [10.0], 0.3)
# Each method gets the same number of gradients: 8 per synchronous or Rennala step, one per
# asynchronous step.
n = max(STEPS // 4, 2)
methods = {"synchronous": (sim.synchronous_sgd(), n),
           "asynchronous": (sim.asynchronous_sgd(), 8 * n),
           "Rennala (B=8)": (sim.rennala_sgd(8), n)}
fig, ax = plt.subplots(figsize=(5, 3))
for name, (method, steps) in methods.items():
  r = sim.simulate_workers(method, grad_fn, loss_fn_q, jnp.zeros(4), compute, mesh=mesh,
                           steps=steps, lr=0.1)
  ax.plot(r.time, r.loss, label=name)
  print(f"{name:14s} final loss {r.loss[-1]:.3f} at simulated t = {r.time[-1]:.1f} s")
ax.set_xlabel("simulated time (s)"); ax.set_ylabel("loss"); ax.set_yscale("log"); ax.legend()
plt.show()'''),
]

COMPRESSION = [
    md("# Gradient compression: codecs side by side\n\nThe same model and data, with the "
       "gradient sent through different codecs by `sync.compressed`: the loss reached, the "
       "bytes each worker sends per step (counted in the optimiser state), and what an error "
       "memory (`memory=\"ef\"`) changes for biased codecs (sign, top-k)."),
    code(SETUP),
    code(PARAMS.format(steps=200)),
    code('''\
import jax.numpy as jnp, numpy as np, optax
import matplotlib.pyplot as plt
from jaxcomm import codecs, data, models, sync, train

mesh = train.make_mesh({"data": 8}, devices=DEVICES[:8])
digits = data.digits()
model = models.MLP(hidden=(64,), num_classes=10)
params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
loss_fn = models.classifier_loss(model)
key = jax.random.key(1)   # stochastic codecs keep it in state and split it every step
sync_stages = {
    "exact f32": sync.mean("data"),
    "bf16 cast": sync.compressed(codecs.cast(jnp.bfloat16), axis_name="data"),
    "QSGD (7 levels)": sync.compressed(codecs.qsgd(7), axis_name="data", key=key),
    "sign + EF": sync.compressed(codecs.sign(), memory="ef", axis_name="data"),
    "top-k 2%": sync.compressed(codecs.top_k(0.02), axis_name="data"),
    "top-k 2% + EF": sync.compressed(codecs.top_k(0.02), memory="ef", axis_name="data"),
}'''),
    code('''\
runs = {}
for name, stage in sync_stages.items():
  trainer = train.Trainer(loss_fn, optax.chain(stage, optax.adam(3e-3)), mesh,
                          batch_axes="data", has_aux=True)
  state = trainer.init(params)
  losses, sent = [], []
  for step in range(STEPS):
    state, m = trainer.step(state, trainer.shard_batch(digits.batch(step, 256)))
    losses.append(float(m["loss"])); sent.append(int(m["wire_bytes"]))
  runs[name] = dict(losses=losses, bytes=float(np.mean(sent)))
exact = runs["exact f32"]["bytes"]
for name, r in runs.items():
  print(f"{name:16s} loss {r['losses'][-1]:.3f}  bytes/step {r['bytes']:>9,.0f}  "
        f"compression x{exact / r['bytes']:.1f}")'''),
    code('''\
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
for name, r in runs.items():
  a.plot(r["losses"], label=name)
a.set_xlabel("step"); a.set_ylabel("training loss"); a.set_yscale("log"); a.legend(fontsize=8)
b.barh(list(runs), [r["bytes"] for r in runs.values()])
b.set_xlabel("wire bytes per worker per step"); b.set_xscale("log")
plt.tight_layout(); plt.show()'''),
]

LOCAL = [
    md("# Local updates: DiLoCo and Streaming DiLoCo against data parallelism\n\nDiLoCo lets "
       "every worker take H inner steps on its own, then all-reduces the averaged progress "
       "once (an outer step). Streaming DiLoCo syncs one fragment of the parameters at a "
       "time, in low precision, overlapped with the next inner steps. We compare loss per "
       "step, bytes per step, and simulated wall-clock time on a wide-area link "
       "(`comm.cost` + `sim.simulate`)."),
    code(SETUP),
    code(PARAMS.format(steps=200) + '''
SYNC_EVERY = max(min(STEPS // 4, 10), 2)   # H: inner steps between syncs
COMPUTE_SECONDS = 0.05                     # assumed compute time of one step per worker'''),
    code('''\
import jax.numpy as jnp, numpy as np, optax
import matplotlib.pyplot as plt
from jaxcomm import comm, data, local, models, sim, sync, train

mesh = train.make_mesh({"data": 8}, devices=DEVICES[:8])
digits = data.digits()
model = models.MLP(hidden=(64,), num_classes=10)
params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
loss_fn = models.classifier_loss(model)
outer = lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)   # the DiLoCo paper's outer step
methods = {
    "DP (all-reduce)": (optax.chain(sync.mean("data"), optax.adam(3e-3)), 0),
    f"DiLoCo H={SYNC_EVERY}": (local.diloco(optax.adam(3e-3), outer(), SYNC_EVERY), 0),
    f"Streaming DiLoCo H={SYNC_EVERY}, P=2, tau=1": (
        local.streaming_diloco(optax.adam(3e-3), outer(), SYNC_EVERY, fragments=2, overlap=1),
        1),   # overlap steps: a fragment merges tau = 1 inner step after it is sent
}'''),
    code('''\
runs = {}
for name, (tx, overlap) in methods.items():
  trainer = train.Trainer(loss_fn, tx, mesh, batch_axes="data", has_aux=True)
  state = trainer.init(params)
  losses, sent = [], []
  for step in range(STEPS):
    batch = trainer.shard_batch(digits.batch(step, 256))
    state, m = trainer.step(state, batch)
    losses.append(float(m["loss"])); sent.append(int(m["wire_bytes"]))
  # What the compiled step's collectives cost on a WAN, charged to the steps that sent them.
  costed = comm.cost(comm.inspect(trainer.step_fn(state, batch), state, batch), {"data": "wan"})
  timeline = sim.simulate(COMPUTE_SECONDS, sim.comm_seconds_per_step(sent, costed),
                          overlap_steps=overlap)
  # timeline.known: when each step's loss is known (it and every earlier step are done).
  # Monotone, unlike a step's own end, which with overlap can come before an earlier sync's
  # end: the clock every loss-vs-time plot reads (experiments.compare's too).
  runs[name] = dict(losses=losses, sent=sent, time=timeline.known)
  print(f"{name:34s} loss {losses[-1]:.3f}  mean bytes/step {np.mean(sent):>9,.0f}  "
        f"simulated time {timeline.total:.2f} s")'''),
    code('''\
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
for name, r in runs.items():
  a.plot(r["losses"], label=name)
  b.plot(r["time"], r["losses"], label=name)
a.set_xlabel("step"); a.set_ylabel("training loss (mean over workers)"); a.set_yscale("log")
b.set_xlabel("simulated time on a WAN (s)"); b.set_ylabel("training loss"); b.set_yscale("log")
a.legend(fontsize=8); plt.tight_layout(); plt.show()'''),
    md("## Your own model on your own text files\n\nA Flax NNX model written here (not one "
       "of jaxcomm's), with dropout, trained with DiLoCo on a folder of text files through a "
       "grain pipeline (`data.batches`), by `train.fit`: a tqdm bar, `metrics.jsonl` and "
       "TensorBoard event files in the workdir. The Trainer splits the model into its "
       "parameters (what DiLoCo and the collectives see) and its other variables, and "
       "reseeds the dropout stream every step and worker from (seed, step, worker)."),
    code('''\
import json, pathlib, shutil, tempfile
from flax import nnx

class CharMLP(nnx.Module):
  """Each next byte from the previous `context` bytes: embed, concatenate, MLP, dropout."""

  def __init__(self, context=4, width=128, *, rngs):
    self.context = context
    self.embed = nnx.Embed(256, 32, rngs=rngs)
    self.hidden = nnx.Linear(32 * context, width, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(width, 256, rngs=rngs)

  def __call__(self, tokens):                      # i32[B, T] -> logits f32[B, T, 256]
    x = jnp.pad(self.embed(tokens), ((0, 0), (self.context - 1, 0), (0, 0)))
    t = tokens.shape[1]
    window = jnp.concatenate([x[:, i:i + t] for i in range(self.context)], axis=-1)
    return self.out(self.dropout(jax.nn.relu(self.hidden(window))))

# A folder of text files: a few of Python's own modules stand in for yours.
folder = pathlib.Path(tempfile.mkdtemp())
for module in (json, tempfile, shutil):
  shutil.copy(module.__file__, folder)
batches = data.batches(f"folder:{folder}", 64, seq_len=32, seed=0)   # grain: batches[step]
trainer = train.Trainer(models.nnx_lm_loss, local.diloco(optax.adam(3e-3), outer(), SYNC_EVERY),
                        mesh, batch_axes="data")
model = CharMLP(rngs=nnx.Rngs(params=0, dropout=1))
workdir = tempfile.mkdtemp()
state, history = train.fit(trainer, trainer.init(model), batches.__getitem__, STEPS,
                           workdir=workdir, log_every=max(STEPS // 10, 1))
print(f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}, "
      f"{history[-1]['total_wire_bytes']:,} bytes sent; TensorBoard logs in {workdir}")
trained = trainer.model(state)   # the trained CharMLP (worker 0's copy), an nnx.Module'''),
    md("`%load_ext tensorboard` and `%tensorboard --logdir <workdir>` show the loss, bytes per "
       "step, cumulative bytes, the workers' consensus distance and (text tab) the compiled "
       "step's bytes per mesh axis."),
]

LAYOUTS = [
    md("# Layouts: data, tensor and sequence parallelism on one mesh\n\nThe same small "
       "transformer LM laid out three ways at once on 8 devices (data x tensor with Megatron "
       "sequence parallelism), checked against the one-device model; the bytes each layout "
       "puts on every mesh axis per training step, read from the compiled program; and the "
       "sequence-parallel attention kernels (ring, Ulysses, LASP-2 and All-Scan for linear "
       "attention) side by side.\n\n"
       "Where things live: meshes `parallel.make_mesh` (`jaxcomm/parallel/_mesh.py`), logical "
       "axis rules `parallel.make_rules` / `param_specs` (`_rules.py`), `parallel.Layout` "
       "(`_layout.py`), Megatron layers `dense_column` / `dense_row` / `mlp_tp` "
       "(`_tensor.py`), `parallel.zero` (`_zero.py`), the attention kernels "
       "(`_ring_attention.py`, `_ulysses.py`, `_linear_attention.py`); the LM "
       "`models.TransformerLM(layout=...)` (`jaxcomm/models/_transformer.py`); "
       "`comm.inspect` (`jaxcomm/comm/_inspect.py`)."),
    code(SETUP),
    code(PARAMS.format(steps=20)),
    code('''\
import functools
import jax.numpy as jnp, numpy as np, optax
import matplotlib.pyplot as plt
from jax.sharding import PartitionSpec as P
from jaxcomm import comm, data, models, parallel, sync, train

# Exact comparisons below: float32 matmuls everywhere (TPUs and recent GPUs default to
# bf16 / TF32 passes for float32 matmuls, which differ more than the layouts do).
jax.config.update("jax_default_matmul_precision", "highest")
SIZES = dict(d_model=32, num_layers=1, num_heads=4, d_ff=128, max_len=32)
SEQ, BATCH = 32, 16
corpus = data.pydoc_text()
batches = [corpus.batch(step, BATCH, seq_len=SEQ) for step in range(STEPS)]
# init always returns the whole parameters, the same for every layout.
params = jax.jit(models.TransformerLM(**SIZES).init)(jax.random.key(0),
                                                     jnp.zeros((1, SEQ), jnp.int32))


def lm_trainer(mesh_shape, zero_stage=0, **options):
  """A Trainer for the LM laid out on `mesh_shape` (AdamW; ZeRO-1 or ZeRO-3 when asked)."""
  layout = parallel.Layout(parallel.make_mesh(mesh_shape, devices=DEVICES[:8]), **options)
  lm = models.TransformerLM(**SIZES, layout=layout)
  # Logical names (embed, heads, mlp, ...) -> mesh axes by the layout's rules.
  specs = layout.param_specs(lm.param_axes(), params, max_replicated=1.0)
  inner = optax.adamw(3e-3)
  if layout.gather_axes:  # parameters stored sharded over `fsdp`: ZeRO-3
    inner = parallel.zero(inner, 3, layout.gather_axes, param_specs=specs,
                          regather=lm.param_regather())
  rest = tuple(a for a in layout.batch_axes if a not in layout.gather_axes) or None
  tx = parallel.zero(inner, 1, rest) if zero_stage == 1 else optax.chain(sync.mean(rest), inner)
  trainer = train.Trainer(models.lm_loss(lm), tx, layout.mesh, batch_axes=layout.batch_axes,
                          param_specs=specs)
  return trainer, specs'''),
    md("## 1. DP x TP x SP: the sharded LM trains like the one-device LM\n\nA mesh "
       "`data=2 x tensor=4`: the batch is split over `data`; each block's heads and MLP "
       "columns over `tensor` (Megatron); with `sequence_parallel=True` the activations "
       "between blocks are split along the sequence over `tensor` too, so each block's "
       "all-reduce becomes an all-gather before it and a reduce-scatter after it. We train "
       "it and the plain one-device model from the same parameters on the same batches "
       "and compare the losses step by step."),
    code('''\
trainer, specs = lm_trainer({"data": 2, "tensor": 4}, sequence_parallel=True)
print("block0 specs:", {k: jax.tree.map(str, v, is_leaf=lambda x: isinstance(x, P))
                        for k, v in specs["params"]["block0"].items() if k in ("qkv", "fc_in")})
state = trainer.init(params)
sharded = []
for b in batches:
  state, m = trainer.step(state, trainer.shard_batch(b))
  sharded.append(float(m["loss"]))

reference, opt = models.TransformerLM(**SIZES), optax.adamw(3e-3)

@jax.jit
def step_one_device(p, o, batch):
  loss, grads = jax.value_and_grad(models.lm_loss(reference))(p, batch)
  updates, o = opt.update(grads, o, p)
  return optax.apply_updates(p, updates), o, loss

p = jax.device_put(params, DEVICES[0])   # the reference runs on one of the mesh's devices
o, single = opt.init(p), []
for b in batches:
  p, o, loss = step_one_device(p, o, b)
  single.append(float(loss))
for t in sorted({0, len(batches) // 2, len(batches) - 1}):
  print(f"step {t:3d}  loss data x tensor + SP {sharded[t]:.6f}   one device {single[t]:.6f}")
rel = np.max(np.abs(np.subtract(sharded, single)) / np.abs(single))
print(f"largest relative difference over {len(batches)} steps: {rel:.1e}")
np.testing.assert_allclose(sharded, single, rtol=1e-4)'''),
    md("Every collective of that compiled step: the tensor axis carries the sequence-parallel "
       "all-gathers and reduce-scatters (forward and backward) and one combined all-reduce "
       "(the gradients of the norms and output biases, which each device computes on its "
       "slice of the sequence, and the backward of taking that slice); the data axis "
       "carries the gradient mean, whose bytes the optimiser also counts in its state "
       "(`wire_bytes`)."),
    code('''\
batch = trainer.shard_batch(batches[-1])
report = comm.inspect(trainer.step_fn(state, batch), state, batch)
print(report.table())
assert report.wire_bytes() - report.wire_bytes(axes=("tensor",)) == int(m["wire_bytes"])'''),
    md("## 2. Bytes per mesh axis, layout by layout\n\nOne training step of the same LM "
       "and global batch under each layout, compiled and read with `comm.inspect(...)"
       ".by_axis()`: per-device wire bytes on each mesh axis. ZeRO-1 sends what DP sends "
       "(a reduce-scatter and an all-gather instead of an all-reduce) but keeps 1/8 of the "
       "optimiser state per device; ZeRO-3 stores 1/8 of the parameters too and gathers "
       "them layer by layer, in the forward and again in the backward pass. "
       "Tensor parallelism shrinks the data-axis traffic (each device all-reduces only its "
       "quarter of the block weights' gradient, over 2 data workers instead of 8) and adds "
       "activation traffic on `tensor`; sequence parallelism splits the activations between "
       "blocks (less memory) for a few more bytes: the gather before the head and the "
       "all-reduce of the norm and bias gradients, which each device now computes on its "
       "slice of the sequence. "
       "`benchmarks/layouts.py` prints the larger table (pipeline and sequence axes, "
       "per-device memory)."),
    code('''\
LAYOUTS = {
    "DP (data 8)": dict(mesh_shape={"data": 8}),
    "ZeRO-1 (data 8)": dict(mesh_shape={"data": 8}, zero_stage=1),
    "ZeRO-3 (fsdp 8)": dict(mesh_shape={"fsdp": 8}),
    "data 2 x tensor 4": dict(mesh_shape={"data": 2, "tensor": 4}),
}
by_layout = {}
for name, kwargs in LAYOUTS.items():
  tr, _ = lm_trainer(**kwargs)
  st, b = tr.init(params), tr.shard_batch(batches[0])
  by_layout[name] = comm.inspect(tr.step_fn(st, b), st, b).by_axis()
by_layout["data 2 x tensor 4 + SP"] = report.by_axis()   # section 1's step
AXIS_NAMES = ("data", "fsdp", "tensor")
assert all(len(k) == 1 and k[0] in AXIS_NAMES for r in by_layout.values() for k in r)
print(f"{'layout':<24}" + "".join(f"{a:>10}" for a in AXIS_NAMES) + f"{'total':>10}")
for name, r in by_layout.items():
  print(f"{name:<24}" + "".join(f"{r.get((a,), 0):>10,.0f}" for a in AXIS_NAMES)
        + f"{sum(r.values()):>10,.0f}")'''),
    code('''\
fig, ax = plt.subplots(figsize=(7, 3))
names, left = list(by_layout)[::-1], np.zeros(len(by_layout))
for i, axis in enumerate(AXIS_NAMES):
  width = np.array([by_layout[n].get((axis,), 0) / 1024 for n in names])
  ax.barh(names, width, left=left, label=axis, color=f"C{i}")
  left += width
ax.set_xlabel("wire KiB per device per training step"); ax.set_ylabel("layout")
ax.legend(title="mesh axis"); plt.tight_layout(); plt.show()'''),
    md("## 3. Sequence-parallel attention: ring, Ulysses, LASP-2, All-Scan\n\nOn a "
       "`data=2 x sequence=4` mesh each device holds a contiguous quarter of the sequence. "
       "Ring attention passes K/V blocks around the ring (W-1 hops); Ulysses swaps "
       "sequence shards for head shards with two all-to-alls; for linear attention "
       "(decayed, as in RetNet / Lightning attention) LASP-2 all-gathers one Dk x Dv state "
       "per device and All-Scan passes it along a pipelined scan. Each kernel's output "
       "equals one-device attention; the forward bytes, read from the compiled program, "
       "match the formulas `parallel.*_bytes`, which also give the backward pass's "
       "(`tests/test_sequence_parallel.py` holds gradients and backward bytes too); "
       "`python -m experiments.train --config=experiments/configs/layouts.py "
       "--config.mesh=data=2,sequence=4 --config.model.attention=ring` trains the LM with "
       "them."),
    code('''\
W, B, H, DH = 4, 2, 4, 8
SEQ_LENS = (32, 128)
seq_mesh = parallel.make_mesh({"data": 2, "sequence": W}, devices=DEVICES[:8])
DECAY = np.linspace(0.6, 1.0, H).astype(np.float32)   # per-head decay of linear attention
linear = functools.partial(parallel.linear_attention, decay=DECAY)
VARIANTS = {  # name: (kernel on one sequence block, one-device reference, bytes formula)
    "ring": (parallel.attention_ring, models.causal_attention, parallel.attention_ring_bytes),
    "Ulysses": (parallel.attention_ulysses, models.causal_attention,
                parallel.attention_ulysses_bytes),
    "LASP-2 (linear)": (functools.partial(parallel.linear_attention_lasp2, decay=DECAY), linear,
                        parallel.linear_attention_lasp2_bytes),
    "All-Scan (linear)": (functools.partial(parallel.linear_attention_allscan, decay=DECAY),
                          linear, parallel.linear_attention_allscan_bytes),
}
spec = P("data", "sequence")
seq_bytes = {}
for name, (kernel, reference, formula) in VARIANTS.items():
  sharded = jax.jit(jax.shard_map(functools.partial(kernel, axis_name="sequence"),
                                  mesh=seq_mesh, in_specs=(spec,) * 3, out_specs=spec))
  seq_bytes[name] = []
  for t in SEQ_LENS:
    q, k, v = 0.5 * np.random.default_rng(t).standard_normal((3, B, t, H, DH), np.float32)
    err = np.max(np.abs(np.asarray(sharded(q, k, v)) - np.asarray(reference(q, k, v))))
    assert err < 1e-4, (name, t, err)
    sent = comm.inspect(sharded, q, k, v, mesh=seq_mesh).wire_bytes(axes=("sequence",))
    expected = formula((B // 2, t // W, H, DH), W)   # one device's block [B/2, T/W, H, Dh]
    assert sent == expected["forward"], (name, t, sent, expected)
    seq_bytes[name].append(sent)
  print(f"{name:18s} max |out - one device| {err:.1e}   forward bytes/device by T: "
        + ", ".join(f"{t}: {n:,.0f}" for t, n in zip(SEQ_LENS, seq_bytes[name]))
        + f"   (backward at T={t}: {expected['backward']:,.0f})")
# Softmax variants move K/V (or Q/K/V/O): linear in T. Linear attention moves states: flat.
assert seq_bytes["ring"][-1] == seq_bytes["ring"][0] * SEQ_LENS[-1] / SEQ_LENS[0]
assert len(set(seq_bytes["LASP-2 (linear)"])) == 1'''),
    code('''\
fig, ax = plt.subplots(figsize=(5.5, 3.5))
for name, sent in seq_bytes.items():
  ax.plot(SEQ_LENS, np.array(sent) / 1024, "o-", label=name)
ax.set_xticks(SEQ_LENS)
ax.set_xlabel("sequence length T (W = 4 devices on the sequence axis)")
ax.set_ylabel("wire KiB per device (forward)")
ax.set_title("one attention layer, sequence-parallel"); ax.legend()
plt.tight_layout(); plt.show()'''),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_compression.ipynb": COMPRESSION,
    "03_local_updates.ipynb": LOCAL,
    "04_layouts.ipynb": LAYOUTS,
    "05_gossip_heterogeneous.ipynb": GOSSIP,
}
# Notebooks whose APIs are not merged yet are left out until they are.
REQUIRES = {"03_local_updates.ipynb": ("local", "streaming_diloco")}


def main():
  import importlib
  for filename, cells in NOTEBOOKS.items():
    if filename in REQUIRES:
      sub, name = REQUIRES[filename]
      if not hasattr(importlib.import_module(f"jaxcomm.{sub}"), name):
        print(f"skipped {filename}: jaxcomm.{sub}.{name} is not there yet")
        continue
    intro = md(SETUP_MD.format(devices=DEVICE_NOTES[filename]))
    nb = nbformat.v4.new_notebook(cells=[cells[0], intro, *cells[1:]])
    for i, cell in enumerate(nb.cells):  # stable ids: regenerating changes nothing
      cell.id = f"cell-{i}"
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["accelerator"] = "GPU"
    nb.metadata["colab"] = {"provenance": []}
    nbformat.validate(nb)
    nbformat.write(nb, HERE / filename)
    print("wrote", HERE / filename)


if __name__ == "__main__":
  main()
