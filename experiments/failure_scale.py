r"""Goodput against scale: each failure semantics from 16 to 10^6 devices, simulated event by
event without training (`jaxcomm.sim.simulate_failures`).

  python -m experiments.failure_scale --out=runs/failure_scale.json
  python -m experiments.failure_scale --config.failures=llama3 --config.unit_devices=0

Methods and their semantics (experiments/methods/*.py declare them):

* DP with checkpoints (`restart`): saves every Young interval; any failure stops the job.
* elastic DiLoCo and Streaming DiLoCo (`elastic`, the runtime's rules): a round is H steps
  (the runtime ends Streaming DiLoCo's rounds at `sync_every` too, so their goodputs
  coincide; they differ in the failure-free clock, which goodput divides out).
* Decoupled DiLoCo (`decoupled`): a learner delivers a fragment every H / P steps.

Replicas (learners) hold `unit_devices` devices each (`units` of them when `unit_devices` is
0). Each cell is the median over `seeds` failure draws of a `horizon_h`-hour run whose
failure-free step takes `step_s`; prints a markdown table and, with --out, the JSON.
"""

from __future__ import annotations

import statistics

import ml_collections
from absl import flags

from jaxcomm import sim

from . import _cli
from . import toolkit

METHODS = {  # name: (semantics, steps per round or delivery)
    "DP + checkpoints": ("restart", lambda c: 1),
    "elastic DiLoCo": ("elastic", lambda c: c.sync_every),
    "Streaming DiLoCo": ("elastic", lambda c: c.sync_every),
    "Decoupled DiLoCo": ("decoupled", lambda c: max(1, c.sync_every // c.fragments)),
}


def get_config() -> ml_collections.ConfigDict:
  """The study's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      failures="yearly",        # a preset or spec of `jaxcomm.sim.failure_model`
      devices=(16, 256, 4096, 65536, 1048576),
      unit_devices=256,         # devices per replica / learner (0: `units` of them)
      units=8,                  # replicas / learners when unit_devices is 0
      sync_every=100,           # H
      fragments=4,              # P (Streaming and Decoupled DiLoCo)
      step_s=1.0,               # failure-free seconds per step
      horizon_h=168.0,          # simulated hours per run
      seeds=3))


def check(c) -> sim.FailureModel:
  """The settings, checked (ValueError naming the first out of range); the model."""
  toolkit.values_at_least(c, "devices", 1)
  for name in ("unit_devices",):
    toolkit.int_at_least(c, name, 0)
  for name in ("units", "sync_every", "fragments", "seeds"):
    toolkit.int_at_least(c, name, 1)
  for name in ("step_s", "horizon_h"):
    toolkit.number_in(c, name, 0.0, low_open=True)
  try:
    return sim.failure_model(c.failures)
  except ValueError as e:
    raise ValueError(f"config.failures: {e}") from None


def units_for(c, devices: int) -> int:
  """Replicas (learners) of a run of `devices` devices."""
  if c.unit_devices:
    return max(1, devices // c.unit_devices)
  return min(c.units, devices)


def table(c, model: sim.FailureModel) -> list[dict]:
  """One row per device count: the median goodput of each method."""
  rows = []
  for devices in c.devices:
    units = units_for(c, devices)
    row = {"devices": devices, "units": units}
    for name, (kind, steps) in METHODS.items():
      semantics = sim.Semantics(kind, units if kind != "restart" else 1, steps(c))
      runs = [sim.simulate_failures(model, devices, semantics, c.step_s,
                                    horizon_s=c.horizon_h * 3600, seed=s).goodput
              for s in range(c.seeds)]
      row[name] = statistics.median(runs)
      row[f"{name} (first order)"] = sim.expected_goodput(model, devices, semantics, c.step_s)
    rows.append(row)
  return rows


def markdown(rows: list[dict]) -> str:
  head = "| devices | replicas | " + " | ".join(METHODS) + " |"
  lines = [head, "|" + "---|" * (2 + len(METHODS))]
  for r in rows:
    lines.append(f"| {r['devices']:,} | {r['units']:,} | "
                 + " | ".join(f"{r[name]:.3f}" for name in METHODS) + " |")
  return "\n".join(lines)


def main(argv):
  del argv
  c = flags.FLAGS.config
  model = check(c)
  rows = table(c, model)
  print(f"failure model: {model}")
  print(markdown(rows))
  _cli.write_json(flags.FLAGS.out, {"settings": c.to_dict(), "model": model._asdict(),
                                    "rows": rows})


if __name__ == "__main__":
  _cli.run(main, get_config(), out=True)
