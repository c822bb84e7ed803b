"""The simulated clock of experiments.compare: one measured compute figure per local step,
its forward / backward / update shares from XLA's cost analysis, and each run's timeline on
each link (the backward pass overlapped bucket by bucket for the methods that can).

Methods whose worker does the same local computation share one compute figure: a method
module's `local_step(settings)` names it ("inner": the gradient and the inner optimiser,
which data parallelism, DiLoCo and Streaming DiLoCo all run per step; their syncs and
casts are the method's communication, or amortised over H steps); a method without one
is measured on its own one-device step (its codec, ACCO's micro-batches, DeMo's
transform). Every figure is timed in the same interleaved rounds (one call of each per
round), and the median is kept with the spread."""

from __future__ import annotations

import hashlib
import math

import jax
import numpy as np
import optax

from .. import build
from jaxcomm import comm, sim

INNER = "inner"


def local_step_key(label: str, config) -> str:
  """The name of the local computation a method's worker runs each step."""
  key = build.hooks(config.method.name).local_step(config.method)
  if key == INNER:
    return INNER
  # The method's own settings decide its local step (a learning rate does not): settings of
  # a tuned list that differ only in the optimizer's share one figure.
  text = ",".join(f"{k}={v}" for k, v in sorted(config.method.to_dict().items()))
  return f"{label}#{hashlib.sha1(text.encode()).hexdigest()[:6]}"


def local_step(config, loss_fn, params, batch, inner_only: bool):
  """One worker's step with no communication, jitted, with its arguments: the method built
  for one device (axis_name=None), or only the gradient and the inner optimiser."""

  ctx = build.local_context(config)
  tx = ctx.inner if inner_only else build.make_optimizer(config, ctx)
  loss_fn = loss_fn if inner_only else build.task_loss(config, loss_fn, ctx)

  def step(p, s, b):
    g = jax.grad(loss_fn)(p, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return jax.jit(step), (params, tx.init(params), batch)


def compile_step(fn, args) -> tuple:
  """Compiles and returns `(compiled, args)`: run in a background thread while a method
  trains, so that XLA's compile uses the other core. The one compiled program is both
  timed (`measure`) and cost-analysed (`shares`)."""
  compiled = fn.lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  return compiled, args


def measure(steps: dict, repeats: int) -> dict:
  """{key: {"seconds": median, "min", "max", "repeats"}}: one call of each local step per
  round, `repeats` rounds, so that every figure sees the same load on a shared machine.
  `steps` maps keys to (fn, args) or to a future of them."""
  steps = {k: s.result() if hasattr(s, "result") else s for k, s in steps.items()}
  for fn, args in steps.values():  # warm up
    jax.block_until_ready(fn(*args))
  calls = {k: [] for k in steps}
  for _ in range(repeats):
    for k, (fn, args) in steps.items():
      calls[k].append(sim.measure_seconds(fn, *args, repeats=1, warmup=0))
  return {k: {"seconds": float(np.median(v)), "min": float(np.min(v)),
              "max": float(np.max(v)), "repeats": repeats} for k, v in calls.items()}


def all_shares(loss_fn, steps: dict) -> dict:
  """{key: `shares`} of compiled local steps (`steps`: key -> (compiled, args), all on the
  same parameters and batch, `local_steps`): the loss and its gradient compiled once."""
  if not steps:
    return {}
  params, _, batch = next(iter(steps.values()))[1]
  forward = sim.step_flops(loss_fn, params, batch)
  grad = sim.step_flops(jax.grad(loss_fn), params, batch)
  return {key: shares(forward, grad, sim.step_flops(compiled))
          for key, (compiled, _) in steps.items()}


def shares(forward: float, grad: float, step: float) -> dict:
  """The forward, backward and update shares of a local step's compute, from the FLOPs
  XLA's cost analysis counts for the loss, its gradient and the whole step."""
  total = max(step, grad)
  if not total or not forward:
    return {"forward": 1 / 3, "backward": 2 / 3, "update": 0.0, "source": "2:1 rule"}
  return {"forward": forward / total, "backward": (grad - forward) / total,
          "update": (total - grad) / total, "source": "XLA cost analysis (FLOPs)"}


def buckets(params) -> list[float]:
  """Gradient bytes per bucket in the order the backward pass makes them: one bucket per
  top-level module of the parameters, in reverse forward order (the LM's `embed`, `pos`,
  `block*`, `ln_f`, `head`; names the rule does not know keep their tree order)."""
  tree = params.get("params", params) if isinstance(params, dict) else params
  if not isinstance(tree, dict):
    return [float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))]
  order = {"embed": 0, "pos": 1, "ln_f": 1e6, "head": 1e6 + 1}

  def rank(name):
    digits = "".join(ch for ch in name if ch.isdigit())
    return order.get(name, 2 + int(digits) if digits else 1e5)

  names = sorted(tree, key=rank)
  sizes = [float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree[n])))
           for n in names]
  return sizes[::-1]


def overlapped_comm(report, link, compute: float, share: dict, bucket_bytes) -> float:
  """Exposed communication of a step whose every-step collectives overlap the backward pass
  (`sim.backward_overlap`): each bucket sends its share of every collective of the compiled
  step (each a collective of its own, so each pays its latency), and the number of buckets
  is the best of 1, 2, 4, ... contiguous groups of the modules (a tuned DDP bucket size;
  one group is no overlap)."""
  cols = [c for c in report.collectives if not c.in_conditional]
  if not cols:
    return 0.0
  sizes = np.asarray(bucket_bytes, dtype=np.float64)
  best = math.inf
  groups = 1
  while groups <= len(sizes):
    parts = [p.sum() for p in np.array_split(sizes, groups)]
    seconds = [sum(c.trips * comm.collective_time(c.op, c.operand_bytes * p / sizes.sum(),
                                                  c.group_size, link) for c in cols)
               for p in parts]
    o = sim.backward_overlap(compute * share["forward"], compute * share["backward"], parts,
                             seconds, compute * share["update"])
    best = min(best, o.exposed_comm)
    groups *= 2
  return best


def timeline(compute: float, step_bytes, cost, overlap_steps: int, exposed: float | None):
  """The simulated timeline of a run on one link: every step's compute plus the
  communication it counted (`sim.comm_seconds_per_step`), or, for a method overlapped with
  the backward pass, plus its exposed communication `exposed`."""
  if exposed is not None:
    comm_s = np.full(len(step_bytes), exposed)
  else:
    comm_s = sim.comm_seconds_per_step(step_bytes, cost)
  return sim.simulate(np.full(len(comm_s), compute), comm_s, overlap_steps=overlap_steps)


class Clock:
  """Per trial and link: the compute figure of its local step (times `scale`) and, for a
  method overlapped with the backward pass, its exposed communication (cached)."""

  def __init__(self, compute: dict, keys: dict, shares: dict, buckets, links_: dict,
               scale: float = 1.0):
    self.compute, self.keys, self.shares, self.buckets = compute, keys, shares, buckets
    self.links, self.scale, self._exposed = links_, scale, {}

  def seconds(self, trial) -> float:
    return self.compute[self.keys[(trial.label, trial.setting)]]["seconds"] * self.scale

  def __call__(self, trial, link: str):
    compute = self.seconds(trial)
    if not trial.overlap_backward:
      return compute, None
    k = (trial.label, trial.setting, link)
    if k not in self._exposed:
      share = self.shares[self.keys[(trial.label, trial.setting)]]
      self._exposed[k] = overlapped_comm(trial.report, self.links[link], compute,
                                         share, self.buckets)
    return compute, self._exposed[k]



def _workers(config) -> int:
  shape = build.mesh_shape(config.mesh, jax.device_count())
  return math.prod(n for a, n in shape.items() if a not in build.MODEL_AXES)


def local_steps(config, configs: dict, compiler) -> tuple:
  """(keys, steps, loss_fn, params): each trial's compute key (`configs` maps (label,
  setting) to its config), and per key its local step (fn, args, future of its compile
  submitted to `compiler`, an executor that compiles in the background)."""
  _, loss_fn, _, params, batches = build.model_task(config)
  batch = {k: v[:config.data.batch_size // _workers(config)] for k, v in batches(0).items()}
  keys, steps = {}, {}
  for (label, k), cfg in configs.items():
    key = keys[(label, k)] = local_step_key(label, cfg)
    if key not in steps:
      fn, args = local_step(cfg, loss_fn, params, batch, key == INNER)
      steps[key] = (fn, args, compiler.submit(compile_step, fn, args))
  return keys, steps, loss_fn, params


def intervals(trials: list, clock: Clock, steps: int) -> dict:
  """{link: seconds between held-out evaluations}: the latest clock among `trials` (the
  reference's) after `steps` steps, so that the reference is evaluated about every `steps`
  steps on every link and every method on a link at the same times."""
  return {n: max(float(t.clocks(clock)[n].known[steps - 1]) for t in trials)
          for n in clock.links}
