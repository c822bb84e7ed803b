r"""Per-replica sync periods on workers of unequal speed: one H for all against H_r per replica.

  python -m experiments.replica_periods --workdir=runs/replica_periods

DiLoCo (inner SGD, outer Nesterov 0.7 / 0.9) with the MLP on digits, 8 workers; workers 4..7
take `--slow` seconds per inner step, the others 1 s (`sim.fixed`), and a sync costs
`--sync_seconds`. "one H": every worker takes H steps per round, so a round lasts as long as
the slow workers' H steps. "H_r": the slow workers take H / slow steps (`local.diloco(
worker_steps=...)`), so the fast ones never wait, merged uniformly or by tokens
(`weighting="tokens"`). Every run gets the same simulated time (`--budget` rounds of "one H",
`sim.round_seconds`) and trains the rounds that fit. Writes `summary.json` (final loss on
the digits training split at the outer parameters, rounds, inner steps per worker, bytes)
into --workdir and prints the table.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app
from absl import flags

from jaxcomm import data, local, models, sim, train

_WORKDIR = flags.DEFINE_string("workdir", "runs/replica_periods", "Where summary.json goes.")
_H = flags.DEFINE_integer("sync_every", 8, "H: inner steps per round of the fast workers.")
_SLOW = flags.DEFINE_integer("slow", 2, "Seconds per step of workers 4..7 (the others: 1).")
_SYNC = flags.DEFINE_float("sync_seconds", 2.0, "Seconds of one sync.")
_BUDGET = flags.DEFINE_integer("budget", 12, "Rounds of 'one H' that set the time budget.")
_LR = flags.DEFINE_float("lr", 0.1, "Inner SGD step size.")
_BATCH = flags.DEFINE_integer("batch", 64, "Global batch per inner step (8 per worker).")


def main(argv):
  del argv
  jax.config.update("jax_num_cpu_devices", 8)  # before the first computation starts a backend

  w, h = 8, _H.value
  fast, slow_steps = [h] * (w // 2), [max(1, h // _SLOW.value)] * (w // 2)
  times = sim.fixed([1.0] * (w // 2) + [float(_SLOW.value)] * (w // 2))
  key = jax.random.key(0)
  ds = data.digits()
  model = models.MLP(hidden=(32,), num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  full = {"x": jnp.asarray(ds.x), "y": jnp.asarray(ds.y)}
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  one_round = sim.round_seconds(times, key, [h] * w, 1, _SYNC.value)[0]
  budget = _BUDGET.value * one_round
  runs = {
      "one H": ([h] * w, "uniform"),
      "H_r, uniform merge": (fast + slow_steps, "uniform"),
      "H_r, token merge": (fast + slow_steps, "tokens"),
  }
  rows = {}
  for label, (steps, weighting) in runs.items():
    per_round = sim.round_seconds(times, key, steps, 10 * _BUDGET.value, _SYNC.value)
    rounds = int(np.searchsorted(np.cumsum(per_round), budget, side="right"))
    tx = local.diloco(optax.sgd(_LR.value), outer, h, "data",
                      worker_steps=None if len(set(steps)) == 1 else steps,
                      weighting=weighting)
    trainer = train.Trainer(loss, tx, train.make_mesh({"data": w}))
    state = trainer.init(params)
    sent = 0
    for t in range(rounds * h):
      state, m = trainer.step(state, ds.batch(t, _BATCH.value))
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
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(dict(budget_seconds=budget, runs=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main)
