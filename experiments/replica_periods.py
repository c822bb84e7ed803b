r"""Per-replica sync periods on workers of unequal speed: one H for all against H_r per replica.

  python -m experiments.replica_periods --workdir=runs/replica_periods

DiLoCo (inner SGD, outer Nesterov 0.7 / 0.9) with the MLP on digits, 8 workers; workers 4..7
take `slow` seconds per inner step, the others 1 s (`sim.fixed`), and a sync costs
`sync_seconds`. "one H": every worker takes H steps per round, so a round lasts as long as
the slow workers' H steps. "H_r": the slow workers take H / slow steps (`local.diloco(
worker_steps=...)`), so the fast ones never wait, merged uniformly or by tokens
(`weighting="tokens"`). Every run gets the same simulated time (`budget` rounds of "one H",
`sim.round_seconds`) and trains the rounds that fit. Writes `summary.json` (final loss on
the digits training split at the outer parameters, rounds, inner steps per worker, bytes)
into --workdir and prints the table. The settings are `get_config()`'s (`--help` lists
them), e.g. `--config.sync_every=16 --config.slow=4`.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import flags

from . import _cli
from . import toolkit
from jaxcomm import data, local, models, sim, train


def get_config() -> ml_collections.ConfigDict:
  """The study's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      sync_every=8,        # H: inner steps per round of the fast workers
      slow=2,              # seconds per step of workers 4..7 (the others: 1)
      sync_seconds=2.0,    # seconds of one sync
      budget=12,           # rounds of "one H" that set the time budget
      lr=0.1,              # inner SGD step size
      batch=64))           # global batch per inner step (8 per worker)


def check(c) -> None:
  """ValueError naming the first setting out of range."""
  for name in ("sync_every", "slow", "budget", "batch"):
    toolkit.int_at_least(c, name, 1)
  toolkit.number_in(c, "sync_seconds", 0)
  toolkit.number_in(c, "lr", 0, low_open=True)


def main(argv):
  del argv
  c = flags.FLAGS.config
  check(c)
  jax.config.update("jax_num_cpu_devices", 8)  # before the first computation starts a backend

  w, h = 8, c.sync_every
  fast, slow_steps = [h] * (w // 2), [max(1, h // c.slow)] * (w // 2)
  times = sim.fixed([1.0] * (w // 2) + [float(c.slow)] * (w // 2))
  key = jax.random.key(0)
  ds = data.digits()
  model = models.MLP(hidden=(32,), num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  full = {"x": jnp.asarray(ds.x), "y": jnp.asarray(ds.y)}
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  one_round = sim.round_seconds(times, key, [h] * w, 1, c.sync_seconds)[0]
  budget = c.budget * one_round
  runs = {
      "one H": ([h] * w, "uniform"),
      "H_r, uniform merge": (fast + slow_steps, "uniform"),
      "H_r, token merge": (fast + slow_steps, "tokens"),
  }
  rows = {}
  for label, (steps, weighting) in runs.items():
    per_round = sim.round_seconds(times, key, steps, 10 * c.budget, c.sync_seconds)
    rounds = int(np.searchsorted(np.cumsum(per_round), budget, side="right"))
    tx = local.diloco(optax.sgd(c.lr), outer, h, "data",
                      worker_steps=None if len(set(steps)) == 1 else steps,
                      weighting=weighting)
    trainer = train.Trainer(loss, tx, train.make_mesh({"data": w}))
    state = trainer.init(params)
    sent = 0
    for t in range(rounds * h):
      state, m = trainer.step(state, ds.batch(t, c.batch))
      sent += int(m["wire_bytes"])
    rows[label] = dict(rounds=rounds, seconds=float(np.sum(per_round[:rounds])),
                       steps_per_worker=[rounds * s for s in steps], bytes=sent,
                       loss=float(loss(state.opt_state.outer_params, full)))
  print(f"{'run':<22}{'rounds':>7}{'sim. s':>8}{'steps fast/slow':>17}{'bytes':>11}"
        f"{'loss':>8}")
  for label, r in rows.items():
    s = r["steps_per_worker"]
    print(f"{label:<22}{r['rounds']:>7}{r['seconds']:>8.0f}{f'{s[0]}/{s[-1]}':>17}"
          f"{r['bytes']:>11,}{r['loss']:>8.4f}")
  workdir = flags.FLAGS.workdir
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(dict(settings=c.to_dict(), budget_seconds=budget, runs=rows), f, indent=1)


if __name__ == "__main__":
  _cli.run(main, get_config(), workdir="runs/replica_periods")
