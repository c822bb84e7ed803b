r"""Heterogeneous workers: loss against simulated time for four parallel SGD methods.

  python -m experiments.heterogeneous --workdir=runs/heterogeneous

Softmax regression on the digits dataset, 8 workers (emulated devices), each gradient one
minibatch drawn by its key. Three compute-time models, one panel each: one slow worker
(7 workers take 1, one takes 10), log-normal times with different medians per worker, and
heavy-tailed times (1 + 0.1 * Lomax(0.5), infinite mean). Methods: synchronous minibatch SGD,
asynchronous SGD (one gradient per step, so its rate is divided by the number of workers),
Rennala SGD (B = 8) and MindFlayer SGD (one attempt per step, cut at the allotted time).
Writes `heterogeneous.png` and `summary.json` (loss at the common horizon, time to reach
`target_loss`) into --workdir. The settings are `get_config()`'s (`--help` lists them), e.g.
`--config.steps=400 --config.lr=0.1`.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import ml_collections
import optax
from absl import flags

from . import _cli
from . import toolkit
from jaxcomm import data, sim, train


def get_config() -> ml_collections.ConfigDict:
  """The study's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      steps=200,           # server steps of the batch methods (x workers for async)
      lr=0.2,              # step size of the batch methods
      batch=4,             # examples per stochastic gradient
      seed=0,              # seed of compute times and data sampling
      target_loss=0.4))    # loss level for the time-to-target table


def check(c) -> None:
  """ValueError naming the first setting out of range."""
  for name, low in (("steps", 1), ("batch", 1), ("seed", 0)):
    toolkit.int_at_least(c, name, low)
  for name in ("lr", "target_loss"):
    toolkit.number_in(c, name, 0, low_open=True)


def main(argv):
  del argv
  c = flags.FLAGS.config
  check(c)
  jax.config.update("jax_num_cpu_devices", flags.FLAGS.devices)
  import matplotlib  # lazy: heavy, and only plots need it
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ds = data.digits()
  x_all, y_all = jnp.asarray(ds.x), jnp.asarray(ds.y)
  w = jax.device_count()
  mesh = train.make_mesh({"data": w})

  def loss_on(params, x, y):
    logits = x @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def grad_fn(params, key):
    idx = jax.random.randint(key, (c.batch,), 0, x_all.shape[0])
    return jax.grad(loss_on)(params, x_all[idx], y_all[idx])

  loss_fn = lambda params: loss_on(params, x_all, y_all)
  params = {"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)}
  models = {
      "one slow worker (fixed 1 x 7, 10 x 1)": (sim.fixed([1.0] * (w - 1) + [10.0]), 1.5),
      "log-normal (medians 0.5..3, sigma 0.7)": (
          sim.lognormal(np.linspace(0.5, 3.0, w), 0.7), 2.0),
      "heavy-tailed (1 + 0.1 Lomax(0.5))": (sim.heavy_tailed(1.0, 0.1, 0.5), 2.0),
  }
  steps, lr = c.steps, c.lr
  fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.2))
  summary = {}
  for ax, (title, (compute, allotted)) in zip(np.atleast_1d(axes), models.items()):
    runs = [
        (sim.synchronous_sgd(), steps, lr),
        (sim.asynchronous_sgd(), steps * w, lr / w),
        (sim.rennala_sgd(w), steps, lr),
        (sim.mindflayer_sgd(allotted, trials=1), steps, lr),
    ]
    results = [sim.simulate_workers(m, grad_fn, loss_fn, params, compute, mesh=mesh, steps=k, lr=a,
                            key=jax.random.key(c.seed)) for m, k, a in runs]
    horizon = min(r.time[-1] for r in results)
    target = c.target_loss
    summary[title] = {"horizon": horizon, "target_loss": target, "methods": {}}
    for r in results:
      keep = r.time <= horizon
      label = r.method if r.method != "MindFlayer SGD" else f"MindFlayer SGD (t={allotted})"
      if keep.sum() == 1:  # Not one step before the horizon: say when the first one came.
        label += f" (first step at t={r.time[1]:.0f})"
      ax.plot(r.time[keep], r.loss[keep], label=label)
      summary[title]["methods"][r.method] = {
          "loss_at_horizon": r.loss_at(horizon), "time_to_target": r.time_to(target),
          "steps_to_horizon": int(keep.sum() - 1),
          "gradients_used": int(r.used[keep[1:]].sum()),
          "computations_discarded": int(r.discarded[keep[1:]].sum()),
          "max_staleness": int(np.max(r.staleness[keep[1:]], initial=0)),
          "wire_bytes_per_step": r.wire_bytes}
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("simulated time (units of a fast gradient)")
    ax.set_ylabel("training loss (full dataset)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(f"Parallel SGD with heterogeneous workers: softmax regression on digits, {w} "
               "workers", fontsize=11)
  fig.tight_layout()
  workdir = flags.FLAGS.workdir
  os.makedirs(workdir, exist_ok=True)
  fig.savefig(os.path.join(workdir, "heterogeneous.png"), dpi=120)
  with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  for title, s in summary.items():
    print(f"{title}: horizon {s['horizon']:.1f}, target loss {s['target_loss']:.3f}")
    for name, m in s["methods"].items():
      print(f"  {name:22s} loss {m['loss_at_horizon']:.4f}  time to target "
            f"{m['time_to_target']:8.1f}  steps {m['steps_to_horizon']:5d}  "
            f"discarded {m['computations_discarded']:5d}  max staleness {m['max_staleness']}")


if __name__ == "__main__":
  _cli.run(main, get_config(), workdir="runs/heterogeneous", devices=8)
