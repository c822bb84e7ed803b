"""The settings of experiments.compare: config.compare checked, the links, the command
line's flags applied, one method entry applied to the shared config, a method's list of
settings under a ruleset, and one seed's config."""

from __future__ import annotations

import math

from .. import build
from .. import config as _config
from .. import specs, toolkit
from . import failures as failures_
from . import scale as scale_

RULESETS = ("default", "tuned")
MAX_SETTINGS = 5  # the most settings a method's tuning() list may hold


def check(config) -> None:
  """The comparison's own settings (config.compare); the rest is experiments.config.check."""
  _config.check(config)
  c = config.compare
  for name in ("smooth", "compute_repeats", "max_steps", "seeds", "eval_every", "eval_batch"):
    toolkit.int_at_least(config, f"compare.{name}", 1)
  toolkit.one_of(config, "compare.ruleset", RULESETS)
  if c.eval_every > config.steps:
    raise ValueError(f"config.compare.eval_every ({c.eval_every}) must be <= config.steps "
                     f"({config.steps}): the reference's first evaluation sets the interval.")
  if c.reference not in c.get("reference_pool", (c.reference,)):
    raise ValueError(f"config.compare.reference {c.reference!r} must be one of "
                     f"config.compare.reference_pool {tuple(c.reference_pool)}.")
  if c.max_steps < config.steps:
    raise ValueError(f"config.compare.max_steps ({c.max_steps}) must be >= config.steps "
                     f"({config.steps}): the reference trains config.steps to set the budget.")
  toolkit.int_at_least(config, "compare.warmup_steps", 0)
  toolkit.one_of(config, "compare.schedule", _config.SCHEDULES)
  toolkit.number_in(config, "compare.budget", 1)
  toolkit.number_in(config, "compare.decay_fraction", 0, 1, low_open=True, high_open=True)
  if c.target_loss is not None and not math.isfinite(c.target_loss):
    raise ValueError(f"config.compare.target_loss must be finite, got {c.target_loss}.")
  links(config)
  toolkit.one_of(config, "compare.scale", scale_.SCALES)
  toolkit.int_at_least(config, "compare.proxies", 1)
  failures_.model(c.failures)  # ValueError naming --failures
  toolkit.int_at_least(config, "compare.failure_draws", 1)
  if c.proxies > 2:
    raise ValueError(f"config.compare.proxies must be 1 or 2, got {c.proxies}.")
  if c.scale == "scenario":
    scale_.scenario(config)  # each setting of config.compare.scenario, named when wrong
    at_scale(config)


def at_scale(config):
  """`config` as the comparison trains it: with config.compare.scale "scenario", the proxy
  on the scenario's replicas (config.mesh `replica=S,data=8/S` unless config.mesh already
  has a replica axis of S)."""
  if config.compare.scale != "scenario":
    return config
  sites = config.compare.scenario.sites
  if config.mesh:
    shape = build.mesh_shape(config.mesh, scale_.PROXY_DEVICES)
    if shape.get("replica", 1) != sites:
      raise ValueError(f"config.mesh {config.mesh!r} must have replica={sites}, the "
                       f"scenario's sites (config.compare.scenario.sites): the proxy trains "
                       "with one replica per site.")
    return config
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.mesh = scale_.proxy_mesh(config)
  return c


def links(config) -> dict:
  """{name: comm.Link} of config.compare.links (preset names or name:gbit=G,latency_ms=L)."""
  given = list(config.compare.links)
  if not given:
    raise ValueError("config.compare.links is empty: name at least one link.")
  out = {}
  for spec in given:
    link = specs.parse_link(spec, "config.compare.links entry")
    if link.name in out:
      raise ValueError(f"config.compare.links names link {link.name!r} twice.")
    out[link.name] = link
  return out


def with_flags(config, links_=None, custom=(), budget=None, max_steps=None, *,
               ruleset=None, seeds=None, target_loss=None, scale=None, scenario=None,
               proxies=None, failures=None):
  """`config` with the command line's --links, --link, --budget, --max_steps, --ruleset,
  --seeds, --target_loss, --scale, --proxies, --failures and the scenario's flags
  (`scenario`: {setting of config.compare.scenario: value}, those given)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    if scale is not None:
      c.compare.scale = scale
    if proxies is not None:
      c.compare.proxies = int(proxies)
    if failures is not None:
      c.compare.failures = failures
    for key, value in (scenario or {}).items():
      if value is not None:
        c.compare.scenario[key] = value
    if links_ is not None or custom:
      c.compare.links = tuple(c.compare.links if links_ is None else links_) + tuple(custom)
    if budget is not None:
      c.compare.budget = float(budget)
    if max_steps is not None:
      c.compare.max_steps = int(max_steps)
    if ruleset is not None:
      c.compare.ruleset = ruleset
    if seeds is not None:
      c.compare.seeds = int(seeds)
    if target_loss is not None:
      c.compare.target_loss = float(target_loss)
  return c


def method_config(config, entry: dict):
  """`config` with a METHODS entry applied (`config.with_method`, which checks it), and
  compare's learning-rate schedule (config.compare.schedule) on its optimizer."""
  c = _config.with_method(config, entry)
  if c.compare.get("schedule", "constant") != "constant":  # build.py wraps the inner one
    with c.unlocked():
      c.optimizer.schedule = c.compare.schedule
      c.optimizer.warmup_steps = c.compare.warmup_steps
  return c


def settings_list(label: str, entry: dict, ruleset: str) -> list:
  """The METHODS-style entries a method runs under `ruleset`: its own entry (default), or
  its module's `tuning()` list applied to it (tuned; at most MAX_SETTINGS, the same list on
  every link). A tuning item sets method settings by name and the optimizer's by
  `optimizer.<name>`; a module without `tuning()` runs its own entry only."""
  if ruleset == "default":
    return [dict(entry)]
  items = list(build.hooks(entry["method"]).tuning())
  if not 1 <= len(items) <= MAX_SETTINGS:
    raise ValueError(f"{label}: the method module's tuning() lists {len(items)} settings; "
                     f"allowed: 1 to {MAX_SETTINGS}.")
  out = []
  for item in items:
    e = {**entry, "optimizer": dict(entry.get("optimizer", {}))}
    for key, value in item.items():
      if key.startswith("optimizer."):
        e["optimizer"][key.split(".", 1)[1]] = value
      else:
        e[key] = value
    out.append(e)
  return out


def seeded(config, seed: int):
  """`config` for seed number `seed` of a method (config.seed + seed)."""
  c = config.copy_and_resolve_references()
  c.seed = config.seed + seed
  return c

