"""A failure model on the simulated clock: devices fail, failed units come back, jobs save.

Each device fails as a Poisson process of rate 1 / MTBF, independently of the others, so a
group of n devices fails at rate n / MTBF (a job of N devices about every MTBF / N). A failure
takes down its *unit* (the smallest group that fails together: a replica, a learner, or for a
synchronous job the whole job) until it has been replaced or restarted (`restart_s`). What
the rest of the run does meanwhile is the method's failure semantics (`Semantics`,
jaxcomm/sim/_goodput.py). Stragglers: each device's step is slowed, with probability
`straggler_p`, by a factor 1 + `straggler_scale` x Lomax(`straggler_alpha`), and a group that
steps in lockstep waits for its slowest member.

Presets (`FAILURE_PRESETS`, `failure_model("llama3")`):

* `llama3`: per-device MTBF from the Llama 3 report (Dubey et al., arXiv 2407.21783, Table 5):
  419 unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs,
  i.e. 16,384 x 54 x 24 / 419 = 50,677 GPU-hours per interruption. The report gives no
  restart or checkpoint times: restart 10 minutes, save 60 s, restore 120 s and detection
  30 s are our round numbers, not the report's.
* `yearly`: one failure per device-year (MTBF 8,760 h), the round figure summaries of
  Decoupled DiLoCo (arXiv 2604.21428) quote for its simulated chips; we could not read the
  paper's own simulation settings, so the other times are the `llama3` preset's.
* `none`: no failures.

Checkpoint/restart of a synchronous job with interval T (seconds of work between saves),
save cost C, failure rate lambda = N / MTBF, restore D (exposed to failures) and downtime R
(detection + restart, not exposed) has the exact expected time per saved interval

  S = (exp(lambda (T + C)) - 1) (1 / lambda + R + (exp(lambda D) - 1) (1 / lambda + R)),

so goodput = T / S (`checkpoint_goodput`); to first order in lambda it is
1 / (1 + C / T + lambda (T / 2 + R + D)), whose optimum is Young's interval sqrt(2 C / lambda)
(Young 1974; Daly 2006 for the higher-order terms).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from jaxcomm import _validate as v

HOUR = 3600.0


class FailureModel(NamedTuple):
  """What fails, how often, and what it costs (build with `failure_model`)."""
  name: str = "custom"
  mtbf_h: float = math.inf       # mean time between failures of one device, hours (inf: none)
  restart_s: float = 600.0       # a failed unit is replaced/restarted and may rejoin after this
  checkpoint_s: float = 60.0     # one save (a synchronous job stops for it)
  restore_s: float = 120.0       # one restore after a restart (exposed to failures)
  checkpoint_every_s: float = 0.0  # seconds of work between saves; 0: Young's interval
  detect_s: float = 30.0         # until the survivors notice (heartbeat / collective timeout)
  regroup_s: float = 0.0         # elastic: the stall of each change of the live set (a new
                                 # mesh and its compiles, the heal of a joiner)
  straggler_p: float = 0.0       # probability that a device's step is slowed
  straggler_scale: float = 0.5   # a slowed step takes 1 + scale x Lomax(alpha) times as long
  straggler_alpha: float = 3.0   # Lomax tail index (> 1: a finite mean)

  @property
  def rate(self) -> float:
    """Failures per second of one device."""
    return 0.0 if math.isinf(self.mtbf_h) else 1.0 / (self.mtbf_h * HOUR)


_TIMES = dict(restart_s=600.0, checkpoint_s=60.0, restore_s=120.0, detect_s=30.0)
#: The failure models `failure_model` knows by name: `none` (nothing fails), `llama3` (one
#: failure per 50,677 GPU-hours, the Llama 3 report's 419 interruptions of 16,384 GPUs in 54
#: days, arXiv 2407.21783) and `yearly` (one failure per device-year); their restart,
#: checkpoint, restore and detection times are our round numbers.
FAILURE_PRESETS = {
    "none": dict(mtbf_h=math.inf),
    "llama3": dict(mtbf_h=16384 * 54 * 24 / 419, **_TIMES),
    "yearly": dict(mtbf_h=24.0 * 365, **_TIMES),
}
_FIELDS = tuple(f for f in FailureModel._fields if f != "name")


def failure_model(spec: "str | FailureModel" = "none", **overrides) -> FailureModel:
  """A checked `FailureModel` from a preset name, a spec string or keyword settings.

  A spec is a preset name, `key=value` settings, or both: `"llama3"`, `"llama3,restart_s=300"`,
  `"mtbf_h=1000,restart_s=60"` (settings without a preset start from `FailureModel()`'s).

  Raises:
    ValueError: one line naming the bad setting (an unknown preset or key, a value out of
      range).

  >>> m = failure_model("llama3,restart_s=300")
  >>> round(m.mtbf_h), m.restart_s, m.checkpoint_s
  (50677, 300.0, 60.0)
  >>> failure_model("none").rate
  0.0
  """
  if isinstance(spec, FailureModel):
    base, settings = spec._asdict(), {}
  elif isinstance(spec, str):
    base, settings = {}, {}
    for i, part in enumerate(p.strip() for p in spec.split(",") if p.strip()):
      key, eq, value = part.partition("=")
      if not eq:
        if i or part not in FAILURE_PRESETS:
          raise ValueError(f"failures: unknown preset {part!r}; allowed: "
                           f"{', '.join(FAILURE_PRESETS)}, or key=value settings of "
                           f"{', '.join(_FIELDS)}.")
        base = {**FailureModel()._asdict(), "name": part, **FAILURE_PRESETS[part]}
        continue
      if key.strip() not in _FIELDS:
        raise ValueError(f"failures: unknown setting {key.strip()!r}; allowed: "
                         f"{', '.join(_FIELDS)}.")
      try:
        settings[key.strip()] = float(value)
      except ValueError:
        raise ValueError(f"failures: {key.strip()} must be a number, got {value!r}.") from None
  else:
    raise ValueError(f"failures must be a preset name, a spec string or a FailureModel, got "
                     f"{spec!r}.")
  settings.update(overrides)
  fields = {**FailureModel()._asdict(), **base, **settings}
  if settings and not base:
    fields["name"] = "custom"
  elif settings:
    fields["name"] = f"{fields['name']}+" + ",".join(sorted(settings))
  return _check(FailureModel(**fields))


def _check(m: FailureModel) -> FailureModel:
  if not (isinstance(m.mtbf_h, (int, float)) and m.mtbf_h == math.inf):
    v.number("mtbf_h", m.mtbf_h, low=0.0, low_open=True)
  for name in ("restart_s", "checkpoint_s", "restore_s", "checkpoint_every_s", "detect_s",
               "regroup_s"):
    v.number(name, getattr(m, name), low=0.0)
  v.number("straggler_p", m.straggler_p, low=0.0, high=1.0)
  v.number("straggler_scale", m.straggler_scale, low=0.0)
  v.number("straggler_alpha", m.straggler_alpha, low=1.0, low_open=True)
  return m._replace(**{k: float(getattr(m, k)) for k in _FIELDS})


def young_interval(model: FailureModel, devices: int) -> float:
  """Young's checkpoint interval sqrt(2 C MTBF / N) in seconds (inf without failures).

  >>> m = failure_model("mtbf_h=1000,checkpoint_s=50")
  >>> round(young_interval(m, 1000), 1)   # sqrt(2 x 50 x 3600)
  600.0
  """
  devices = v.integer("devices", devices, low=1)
  rate = model.rate * devices
  if rate == 0:
    return math.inf
  return math.sqrt(2.0 * model.checkpoint_s / rate)


def interval(model: FailureModel, devices: int) -> float:
  """The checkpoint interval a synchronous job uses: the model's, or Young's (0)."""
  return model.checkpoint_every_s or young_interval(model, devices)


def checkpoint_goodput(model: FailureModel, devices: int, every_s: float | None = None,
                       slowdown: float = 1.0) -> float:
  """Expected goodput of checkpoint/restart, exact for the model (module docstring).

  Args:
    model: the failure model.
    devices: N, the job's devices (any failure stops the job).
    every_s: seconds of work between saves (None: `interval(model, devices)`).
    slowdown: the job's steps take this many times their failure-free time (stragglers).

  Returns:
    Failure-free seconds of work done per wall second, in (0, 1].

  >>> m = failure_model("mtbf_h=10000,checkpoint_s=60,restore_s=120,restart_s=600,detect_s=0")
  >>> round(checkpoint_goodput(m, 1000), 3)
  0.925
  """
  lam = model.rate * v.integer("devices", devices, low=1)
  t = interval(model, devices) if every_s is None else v.number("every_s", every_s, low=0.0,
                                                                  low_open=True)
  slowdown = v.number("slowdown", slowdown, low=1.0)
  if lam == 0:
    return 1.0 / slowdown if math.isinf(t) else t / (t * slowdown + model.checkpoint_s)
  down = model.detect_s + model.restart_s
  exposed = t * slowdown + model.checkpoint_s
  restore = math.expm1(lam * model.restore_s) * (1.0 / lam + down)
  return t / (math.expm1(lam * exposed) * (1.0 / lam + down + restore))


def first_order_goodput(model: FailureModel, devices: int, every_s: float | None = None
                        ) -> float:
  """Young's first-order goodput 1 / (1 + C / T + lambda (T / 2 + R + D)).

  >>> m = failure_model("mtbf_h=1e6,checkpoint_s=60")
  >>> abs(first_order_goodput(m, 100) - checkpoint_goodput(m, 100)) < 1e-4
  True
  """
  lam = model.rate * v.integer("devices", devices, low=1)
  t = interval(model, devices) if every_s is None else every_s
  if lam == 0:
    return 1.0 if math.isinf(t) else 1.0 / (1.0 + model.checkpoint_s / t)
  down = model.detect_s + model.restart_s + model.restore_s
  return 1.0 / (1.0 + model.checkpoint_s / t + lam * (t / 2.0 + down))


def expected_slowdown(model: FailureModel, devices: int) -> float:
  """E[max over `devices` devices of the step's slowdown factor] (1 without stragglers).

  The largest of n independent factors has the distribution function F^n, so
  E[max] = 1 + integral over x > 0 of (1 - F(x)^n), F(x) = 1 - p (1 + x / scale)^-alpha.

  >>> m = failure_model("straggler_p=1,straggler_scale=1,straggler_alpha=2")
  >>> round(expected_slowdown(m, 1), 3)   # 1 + scale / (alpha - 1)
  2.0
  """
  n = v.integer("devices", devices, low=1)
  p, s, a = model.straggler_p, model.straggler_scale, model.straggler_alpha
  if p == 0 or s == 0:
    return 1.0
  # Substitute x = s (u^(-1/a) - 1), u = (1 + x/s)^-a in (0, 1]: dx = (s/a) u^(-1/a - 1) du.
  u = np.logspace(-300.0 / a if a > 1 else -300, 0.0, 20001)
  with np.errstate(divide="ignore"):              # (log1p(-1) = -inf where p = 1)
    tail = -np.expm1(n * np.log1p(-p * u))        # 1 - F^n at x(u)
  dens = (s / a) * u ** (-1.0 / a - 1.0)
  return 1.0 + float(np.trapezoid(tail * dens, u))


def step_slowdowns(model: FailureModel, devices: int, steps: int, seed: int = 0) -> np.ndarray:
  """f64[steps]: each step's slowdown, the largest of `devices` devices' factors, drawn.

  The maximum of n independent draws with distribution function F is F^-1(U^(1/n)), so one
  uniform per step draws it exactly at any n.

  >>> m = failure_model("straggler_p=0.01,straggler_scale=1,straggler_alpha=2")
  >>> f = step_slowdowns(m, 10**6, 1000)
  >>> bool(f.min() > 1.0)   # with a million devices every step has a straggler
  True
  """
  n = v.integer("devices", devices, low=1)
  steps = v.integer("steps", steps, low=0)
  u = np.random.default_rng(v.integer("seed", seed, low=0)).random(steps)
  p, s, a = model.straggler_p, model.straggler_scale, model.straggler_alpha
  if p == 0:
    return np.ones(steps)
  above = -np.expm1(np.log(np.maximum(u, 1e-300)) / n)  # 1 - U^(1/n): the max's quantile
  slowed = above < p
  tail = np.where(slowed, above / p, 1.0)         # P(extra > x | slowed) = (1 + x/s)^-a
  return 1.0 + np.where(slowed, s * (np.maximum(tail, 1e-300) ** (-1.0 / a) - 1.0), 0.0)


def draw_failures(model: FailureModel, devices: int, units: int, horizon_s: float,
                  seed: int = 0) -> list:
  """Sorted [(seconds, unit), ...]: each unit's failures in [0, horizon_s), drawn.

  Unit u (of `units`, each of devices / units devices) fails as a Poisson process of rate
  devices / (units x MTBF); the schedule can be replayed in a simulation
  (`simulate_failures(..., failures=...)`) or a real run (experiments/failure_replay.py).

  >>> m = failure_model("mtbf_h=0.01")   # 36 s per device
  >>> [(round(t, 1), u) for t, u in draw_failures(m, 3, 3, 30.0, seed=1)]
  [(11.1, 1), (13.2, 2), (17.3, 2)]
  """
  devices = v.integer("devices", devices, low=1)
  units = v.integer("units", units, low=1, high=devices)
  horizon_s = v.number("horizon_s", horizon_s, low=0.0)
  rng = np.random.default_rng(v.integer("seed", seed, low=0))
  rate = model.rate * devices / units
  out = []
  for u in range(units):
    t = 0.0
    while rate:
      t += rng.exponential(1.0 / rate)
      if t >= horizon_s:
        break
      out.append((t, u))
  return sorted(out)
