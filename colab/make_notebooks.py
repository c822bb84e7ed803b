"""Writes the notebooks of colab/ from the cell sources below (outputs cleared).

Run from the repository root: `python colab/make_notebooks.py`. Edit the cells here, not the
.ipynb files, so that the notebooks stay reviewable as code.
"""

import pathlib

import nbformat

HERE = pathlib.Path(__file__).resolve().parent

SETUP = '''\
# Setup: install jaxcomm on Colab; emulate 8 CPU devices when there is no 8-device accelerator.
import os, sys, subprocess
if "google.colab" in sys.modules:
  # The package source; point it at your fork or a release if you use one.
  subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                  os.environ.get("JAXCOMM_PIP", "git+https://github.com/jaxcomm/jaxcomm.git")],
                 check=True)
import jax
# Must run before anything touches devices: only the CPU backend is affected.
jax.config.update("jax_num_cpu_devices", 8)
DEVICES = jax.devices() if jax.device_count() >= 8 else jax.devices("cpu")
print(len(DEVICES), "devices:", DEVICES[0].platform)'''

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
digits = data.digits()
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
runs = {}
for name, tx in optimisers.items():
  trainer = train.Trainer(loss_fn, tx, mesh, axis_name="data", has_aux=True)
  state = trainer.init(params)
  losses, sent = [], []
  for step in range(STEPS):
    batch = trainer.shard_batch(digits.batch(step, 256))
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
  trainer = train.Trainer(loss_fn, tx, mesh, axis_name="data", has_aux=True)
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
methods = {"synchronous": (sim.synchronous_sgd(), n), "asynchronous": (sim.asynchronous_sgd(), 8 * n),
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
                          axis_name="data", has_aux=True)
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
        sim.overlap_steps("streaming_diloco", tau=1)),
}'''),
    code('''\
runs = {}
for name, (tx, overlap) in methods.items():
  trainer = train.Trainer(loss_fn, tx, mesh, axis_name="data", has_aux=True)
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
  runs[name] = dict(losses=losses, sent=sent, done=timeline.done)
  print(f"{name:34s} loss {losses[-1]:.3f}  mean bytes/step {np.mean(sent):>9,.0f}  "
        f"simulated time {timeline.done[-1]:.2f} s")'''),
    code('''\
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
for name, r in runs.items():
  a.plot(r["losses"], label=name)
  b.plot(r["done"], r["losses"], label=name)
a.set_xlabel("step"); a.set_ylabel("training loss (mean over workers)"); a.set_yscale("log")
b.set_xlabel("simulated time on a WAN (s)"); b.set_ylabel("training loss"); b.set_yscale("log")
a.legend(fontsize=8); plt.tight_layout(); plt.show()'''),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_compression.ipynb": COMPRESSION,
    "03_local_updates.ipynb": LOCAL,
    "05_gossip_heterogeneous.ipynb": GOSSIP,
}
# Notebooks whose APIs are not merged yet are left out until they are.
REQUIRES = {"03_local_updates.ipynb": ("local", "streaming_diloco")}


def main():
  import importlib  # pylint: disable=import-outside-toplevel
  for filename, cells in NOTEBOOKS.items():
    if filename in REQUIRES:
      sub, name = REQUIRES[filename]
      if not hasattr(importlib.import_module(f"jaxcomm.{sub}"), name):
        print(f"skipped {filename}: jaxcomm.{sub}.{name} is not there yet")
        continue
    nb = nbformat.v4.new_notebook(cells=cells)
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
