"""The comparison's clock at the user's scale: each method's step planned at a real model's
size on sites x devices (`jaxcomm.plan`), timed on a two-level network (`comm.Sites`).

A scenario (config.compare.scenario) is a model (a preset of experiments/configs/models/, or
a .py file of your own whose `get_config()` has a preset's form), S sites of d devices (the
mesh `replica=S, <inner>=d`), the link inside a site, an accelerator preset and its MFU (or
a measured compute time per step); the links of config.compare.links are the links between
the sites. Each method's step is compiled for that mesh at the model's size but never run:
a stack of identical blocks at 1 and 2 blocks, extrapolated, in a subprocess that emulates
S d CPU devices, kept in a plan cache (plans.py).

Per link, a method's step time at scale is the plan's: compute = FLOPs / (peak x MFU),
communication = each compiled collective costed on `comm.Sites(S, d, link, inside)` and
charged at the steps the method's counters send it, less what its schedule overlaps.
`experiments.compare.step_time(entry, config, link)` (timing.py) is that number for one
method, without training anything.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os

import jax
import ml_collections
import numpy as np

from jaxcomm import _validate, comm, plan, sim

from .. import _plugins, build, specs, toolkit
from . import clock as _clock
from . import plans as plans_

SCALES = ("scenario", "proxy")
INNER_AXES = ("fsdp", "data")
PROXY_DEVICES = 8  # the emulated devices the proxy trains on
_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                       "models")
def preset_names() -> list[str]:
  """The model presets shipped in experiments/configs/models/."""
  return _plugins.available([_MODELS])


def model_preset(name: str) -> dict:
  """A model preset (experiments/configs/models/NAME.py) or a .py file of the same form:
  {"model": {...config.model}, "data", "seq_len", "batch_per_device", "note"}."""
  shipped = preset_names()
  setting = "config.compare.scenario.model"
  if isinstance(name, str) and name.endswith(".py"):
    if not os.path.isfile(name):
      raise ValueError(f"{setting} {name!r}: no such file.")
    spec = importlib.util.spec_from_file_location("jaxcomm_scale_model", name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  elif name in shipped:
    # relative: the wheel installs experiments as jaxcomm.experiments
    module = importlib.import_module(f"..configs.models.{name}", __package__)
  else:
    raise ValueError(f"{setting} must be one of {', '.join(map(repr, shipped))} or a .py file "
                     f"whose get_config() has a preset's form; got {name!r}.")
  preset = module.get_config()
  preset = preset.to_dict() if hasattr(preset, "to_dict") else dict(preset)
  missing = {"model", "data", "seq_len", "batch_per_device"} - set(preset)
  if missing:
    raise ValueError(f"{setting} {name!r}: get_config() lacks {', '.join(sorted(missing))}.")
  return preset


@dataclasses.dataclass(frozen=True)
class Scenario:
  """Where the comparison's clock runs: the model at its size, sites x devices, the links."""
  model: str
  preset: dict
  sites: int
  per_site: int
  inner: str
  inside: comm.Link
  device: plan.Device
  mfu: float
  compute_seconds: float | None
  cache: str

  @property
  def name(self) -> str:
    """The model's name: its preset's, or its file's without the folder."""
    return os.path.basename(self.model)

  @property
  def mesh(self) -> str:
    return f"replica={self.sites},{self.inner}={self.per_site}"

  @property
  def devices(self) -> int:
    return self.sites * self.per_site

  def network(self, between: comm.Link) -> comm.Sites:
    """The two-level network with `between` (a link of config.compare.links) between sites."""
    return comm.Sites(self.sites, self.per_site, between, self.inside, axis="replica")

  def text(self) -> str:
    """One sentence for report.md and the terminal."""
    compute = (f"compute {self.compute_seconds:g} s per step (measured)"
               if self.compute_seconds is not None else
               f"{self.device.name} at MFU {self.mfu:g} (compute = the compiled step's FLOPs "
               f"/ ({self.device.peak_flops / 1e12:g} TFLOP/s x {self.mfu:g}))")
    return (f"{self.name} ({self.preset.get('note', '')}) on {self.sites} sites x "
            f"{self.per_site} devices (mesh {self.mesh}; {self.inside.name or 'inside'} inside "
            f"a site); {compute}")


def scenario(config) -> Scenario:
  """config.compare.scenario, checked: a mistake is one ValueError naming the setting."""
  s = config.compare.scenario
  name = "config.compare.scenario"
  toolkit.int_at_least(config, "compare.scenario.sites", 1)
  toolkit.int_at_least(config, "compare.scenario.per_site", 1)
  sites, per_site = s.sites, s.per_site
  if PROXY_DEVICES % sites:
    raise ValueError(f"{name}.sites ({sites}) must divide the proxy's {PROXY_DEVICES} devices: "
                     "the proxy trains with one replica per site.")
  toolkit.one_of(config, "compare.scenario.inner", INNER_AXES)
  try:
    mfu = plan.check_mfu(s.mfu)
  except ValueError as e:
    raise ValueError(f"{name}.{e}") from None
  _validate.one_of(f"{name}.device", s.device, tuple(plan.DEVICES))
  measured = s.get("compute_seconds")  # a measured compute time per step, or None
  if measured is not None:
    toolkit.number_in(config, "compare.scenario.compute_seconds", 0.0, low_open=True)
  inside = specs.parse_link(s.inside, f"{name}.inside")
  return Scenario(model=s.model, preset=model_preset(s.model), sites=sites, per_site=per_site,
                  inner=s.inner, inside=inside, device=plan.device(s.device), mfu=mfu,
                  compute_seconds=None if measured is None else float(measured),
                  cache=s.get("plan_cache", None) or plans_.default_cache())


def proxy_mesh(config) -> str:
  """The proxy's mesh: one replica per site, data parallel inside (`replica=S,data=8/S`)."""
  sites = config.compare.scenario.sites
  return f"replica={sites},data={PROXY_DEVICES // sites}" if sites > 1 else ""


# ---------------------------------------------------------------- one method's plan
def plan_config(config, sc: Scenario) -> ml_collections.ConfigDict:
  """A method's config (`config`, the proxy's) at the scenario's size and mesh."""
  p = sc.preset
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.mesh = sc.mesh
    c.checkpoint_every = 0
    c.model.update(p["model"])
    c.data.name, c.data.seq_len = p["data"], p["seq_len"]
    c.data.batch_size = p["batch_per_device"] * sc.devices  # replica and inner: batch axes
    c.steps = config.compare.max_steps
  return c


# ---------------------------------------------------------------- the clock at scale
SHARES = {"forward": 1 / 3, "backward": 2 / 3, "update": 0.0, "source": "2:1 rule"}


def abstract_params(c):
  """The parameters of the model of `c` as shapes (nothing is allocated), built on the
  proxy's devices as one data-parallel mesh (a layout does not change their shapes)."""
  flat = c.copy_and_resolve_references()
  with flat.unlocked():
    flat.mesh = ""
  return build.build(flat, jax.devices()[:PROXY_DEVICES], abstract=True).params


def buckets(c) -> list:
  """Gradient bytes per bucket at scale (`clock.buckets` of the model's parameters at the
  scenario's size)."""
  return _clock.buckets(abstract_params(c))


class ScaleClock:
  """The scenario's clock (ALGORITHMS: time to target = clock_{m,L,S}(n_m)): per trial its
  method's plan at scale (`plans[(label, setting)]`), per link the timeline of the planned
  steps on `sc.network(link)`, of which a trial reads the steps it trained.

  Args:
    plans: {(label, setting): plan.StepPlan} at the scenario's size.
    overlaps: {(label, setting): (overlap_steps, overlap_backward)} of the method modules.
    sc: the scenario.
    links_: {name: comm.Link} between the sites (config.compare.links).
    bucket_bytes: gradient bytes per bucket at scale (`buckets`), for overlap_backward.
    scale: a factor on every compute time (the sensitivity lines).
  """

  def __init__(self, plans: dict, overlaps: dict, sc: Scenario, links_: dict,
               bucket_bytes, scale: float = 1.0):
    self.plans, self.overlaps, self.sc, self.links = plans, overlaps, sc, links_
    self.buckets, self.scale, self._full = bucket_bytes, scale, {}

  def compute(self, key) -> float:
    """Compute seconds per step of (label, setting): measured, or FLOPs / (peak x MFU)."""
    sc = self.sc
    seconds = sc.compute_seconds if sc.compute_seconds is not None else \
        plan.compute_seconds(self.plans[key].flops, sc.device, sc.mfu)
    return seconds * self.scale

  def seconds(self, trial) -> float:
    return self.compute((trial.label, trial.setting))

  def full(self, key, link: str):
    """The timeline of every planned step of (label, setting) on `link`."""
    if (key, link) not in self._full:
      p, (overlap, backward) = self.plans[key], self.overlaps[key]
      net, compute = self.sc.network(self.links[link]), self.compute(key)
      if backward:
        exposed = _clock.overlapped_comm(p.report, net, compute, SHARES, self.buckets)
        comm_s = np.full(p.steps, exposed)
      else:
        comm_s = sim.comm_seconds_per_step(p.schedule, comm.cost(p.report, net))
      self._full[(key, link)] = sim.simulate(compute, comm_s, overlap_steps=overlap)
    return self._full[(key, link)]

  def timeline(self, trial, link: str):
    """The trial's timeline on `link` over the steps it trained (a prefix of `full`)."""
    t, n = self.full((trial.label, trial.setting), link), len(trial.history)
    if n > len(t.known):
      raise ValueError(f"{trial.label} trained {n} steps, past the {len(t.known)} planned.")
    return sim.Timeline(t.compute_end[:n], t.comm_end[:n], t.compute_seconds[:n],
                        t.comm_seconds[:n])

  def scaled(self, factor: float) -> "ScaleClock":
    """The same clock with every compute time times `factor` (the sensitivity lines)."""
    return ScaleClock(self.plans, self.overlaps, self.sc, self.links, self.buckets, factor)

  def prediction(self, key, link: str) -> plan.Prediction:
    """Seconds per step of (label, setting) on `link`, means over the planned steps."""
    t = self.full(key, link)
    n = len(t.known)
    return plan.Prediction(compute=float(t.compute_seconds.mean()),
                           comm=float(t.comm_seconds.mean()), exposed=t.exposed_comm / n,
                           step=t.total / n)


def overlaps_of(c) -> tuple:
  """(overlap_steps, overlap_backward) of a method config (its method module's hooks)."""
  hooks = build.hooks(c.method.name)
  return int(hooks.overlap_steps(c.method)), bool(hooks.overlap_backward(c.method))


class Planner:
  """The comparison's plans at scale: one per method and distinct settings (a setting that
  changes only the optimizer's learning rate shares its method's plan), planned in the
  background from the start (`Plans`); `clock` waits for them."""

  def __init__(self, configs: dict, sc: Scenario, log=None):
    self.sc = sc
    self.at_scale = {key: plan_config(c, sc) for key, c in configs.items()}
    names = {}
    for key, c in self.at_scale.items():
      names.setdefault(plans_.key_of(c), key)
    self.name = {key: names[plans_.key_of(c)] for key, c in self.at_scale.items()}
    self.plans = plans_.Plans({f"{k[0]}#{k[1]}": self.at_scale[k]
                               for k in set(self.name.values())}, sc.cache, sc.devices, log)

  def clock(self, links_: dict, pool) -> tuple:
    """(ScaleClock, {label: why it was not planned}); a method of the reference pool that
    cannot be planned is an error."""
    plans, failed = {}, {}
    for key, c in self.at_scale.items():
      label = key[0]
      found = self.plans.get("{}#{}".format(*self.name[key]))
      if isinstance(found, str):
        failed.setdefault(label, found)
      else:
        plans[key] = found
    for label in pool:
      if label in failed:
        raise RuntimeError(f"{label} (of the reference pool) could not be planned at "
                           f"{self.sc.mesh}: {failed[label]}")
    overlaps = {key: overlaps_of(c) for key, c in self.at_scale.items()}
    plans = {k: p for k, p in plans.items() if k[0] not in failed}
    first = next(iter(self.at_scale.values()))
    return ScaleClock(plans, overlaps, self.sc, links_, buckets(first)), failed


def proxy_clock(pops: dict, sc: Scenario, links_: dict) -> _clock.Clock:
  """The proxy's own clock, for the line that shows the regime's effect: each method's step
  as the proxy compiled it (its size, its mesh of S sites x 8 / S devices, on the same links
  between and inside the sites), compute its FLOPs on the scenario's device at its MFU."""
  keys, compute, shares = {}, {}, {}
  for label, ps in pops.items():
    for pop in ps:
      key = keys[(label, pop.setting)] = f"{label}#{pop.setting}"
      compute[key] = {"seconds": plan.compute_seconds(pop.flops, sc.device, sc.mfu)}
      shares[key] = SHARES
  params = next(iter(pops.values()))[0].runs[0].params
  inner = PROXY_DEVICES // sc.sites
  networks = {n: comm.Sites(sc.sites, inner, link, sc.inside, axis="replica")
              for n, link in links_.items()}
  return _clock.Clock(compute, keys, shares, _clock.buckets(params), links_,
                      networks=networks)
