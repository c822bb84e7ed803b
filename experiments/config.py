"""Experiment settings: one typed `ml_collections.ConfigDict` per run, one home per default.

A run's settings form one tree (`base_config`):

  seed, steps, log_every, checkpoint_every, keep, skip_nonfinite
  mesh          "data=8", "data=2,fsdp=2,tensor=2", "replica=2,data=4" ("" = data over all
                devices)
  model         name (a module of experiments/models/: lm, mlp, nnx_lm, nnx_mlp, resnet18,
                resnet50; or a .py file of your own) and the models' settings
  data          name (pydoc | stdlib | digits | text:<path> | synthetic:imagenet |
                synthetic:cifar10), batch_size, seq_len, label_skew
  optimizer     the inner optimiser: name (adamw | adam | sgd | momentum), lr, weight_decay
  method        name, and the method's own settings (see experiments/methods/)
  elastic       enabled (train with jaxcomm.elastic: processes may die, hang and rejoin),
                the failure detection (heartbeat, collective timeout, progress deadline)
                and the quorum rules (jaxcomm.elastic.Quorum)

A method's settings are *read* from its library factory's signature (`from_factory`), so a
default lives in one place, the factory; a config file only sets what an experiment chooses.
Codecs are spec strings in one vocabulary, the factory names of `jaxcomm.codecs`
(`parse_codec`). Files in `experiments/configs/` return such trees from `get_config()`, and
`python -m experiments.train --config=experiments/configs/diloco.py
--config.method.sync_every=50` overrides any field, typed (ml_collections checks the type).

Bad settings fail here, before anything compiles, with a one-line ValueError that names the
setting (`check`).
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
from typing import Any, Callable

import ml_collections
import numpy as np
from ml_collections import config_dict

from experiments import methods, models
from jaxcomm import codecs, comm

PIPELINES = ("numpy", "grain")
OPTIMIZERS = ("adamw", "adam", "sgd", "momentum")
# The inner optimiser's learning-rate schedule (experiments/compare.py's compare.schedule,
# copied to optimizer.schedule; build.py makes the inner optimiser schedule-free, or gives
# it a warmup-stable-decay rate).
SCHEDULES = ("constant", "schedule_free", "wsd")
SPLITS = ("all", "train", "test")


# ---------------------------------------------------------------- settings from signatures
_SIMPLE_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def _type_of(annotation: Any, name: str, factory: Callable) -> type:
  """The field type of a parameter whose default is None, from its annotation."""
  text = annotation if isinstance(annotation, str) else str(annotation)
  for token in (t.strip() for t in text.split("|")):
    if token in _SIMPLE_TYPES:
      return _SIMPLE_TYPES[token]
  raise ValueError(f"{factory.__name__}({name}=None): give the setting's type in `types`.")


def from_factory(factory: Callable, *, skip: tuple = (), types: dict | None = None,
                 **own: Any) -> ml_collections.ConfigDict:
  """A method's settings: every keyword default of `factory` (minus `skip`), plus `own`.

  The factory's defaults are read, never restated, so they have one home. A default of None
  becomes a typed placeholder (from `types` or the annotation) that the command line can set.
  `own` holds settings the factory does not take as such (e.g. `outer_lr` for the outer
  optimiser a method module builds) and may override a default only by naming a setting the
  factory lacks: a clash is an error.

  >>> from jaxcomm import local
  >>> s = from_factory(local.stale, skip=("inner", "axis_name"), delay=1)
  >>> s.delay, s.dc_lambda, s.compensation
  (1, 0.04, None)
  """
  types = dict(types or {})
  params = inspect.signature(factory).parameters
  fields = {}
  hints = {}
  for name, p in params.items():
    if name in skip or p.default is inspect.Parameter.empty:
      continue
    if name in own:
      raise ValueError(f"{factory.__name__} defaults {name}={p.default!r}: a method's "
                       f"settings read it from the factory instead of setting it.")
    hints[name] = p.annotation
    fields[name] = p.default
  cfg = ml_collections.ConfigDict()
  for name, value in {**fields, **own}.items():
    if value is None:
      kind = types.get(name) or _type_of(hints.get(name, ""), name, factory)
      setattr(cfg, name, config_dict.placeholder(kind))
    elif isinstance(value, (bool, int, float, str, tuple)):
      setattr(cfg, name, value)
    elif name in types:  # an object default (a codec, ...) shown as its spec string
      setattr(cfg, name, config_dict.placeholder(types[name]))
    else:
      raise ValueError(f"{factory.__name__}({name}={value!r}): a default that is not a "
                       f"number, string or None needs a spec type in `types`.")
  return cfg


# ---------------------------------------------------------------- the whole tree
def base_config(method: str = "dp", **method_settings: Any) -> ml_collections.ConfigDict:
  """Every setting of a run, with `method`'s settings (its defaults, then `method_settings`).

  `method` is a name in experiments/methods/, a dotted module path or a `.py` file path (a
  method of your own: the contract is in experiments/build.py's module docstring).
  """
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.steps = 200
  c.log_every = 10
  c.checkpoint_every = 100   # 0: no checkpoints
  c.keep = 3                 # checkpoints kept
  c.skip_nonfinite = False   # skip steps whose gradient is not finite on any worker
  c.mesh = ""                # "" = one data axis over every device
  # Every shipped model's settings (experiments/models/<name>.py's defaults()), so that the
  # command line can switch the model and set its settings; each model reads its own.
  c.model = models.shared_fields()
  c.model.name = "lm"
  c.data = ml_collections.ConfigDict(dict(
      name="pydoc", batch_size=32, seq_len=64,
      split="all",           # all | train | test (the dataset's own held-out split)
      # numpy: batches drawn by step from the embedded arrays; grain: a grain.MapDataset
      # indexed by step (shuffled epochs; needed for folder:<path> of text files).
      pipeline="numpy",
      label_skew=0.0))       # MLP: Dirichlet alpha of a label-skewed split (0: iid)
  c.optimizer = ml_collections.ConfigDict(dict(name="adamw", lr=3e-3, weight_decay=0.0))
  c.method = _method_settings(method, **method_settings)
  c.elastic = elastic_defaults()
  return c


def elastic_defaults() -> ml_collections.ConfigDict:
  """The elastic settings (`jaxcomm.elastic`; used when `enabled`), one home."""
  return ml_collections.ConfigDict(dict(
      enabled=False,
      heartbeat_timeout_s=10,     # a silent process is declared dead (coordination service)
      collective_timeout_s=30,    # a cross-process collective fails after this (XLA:CPU)
      deadline_s=0.0,             # progress deadline for a missing vote (0: 3x median round)
      min_workers="1",            # processes a round needs: "N", or "N@T,..." from step T
      majority=True,              # a new quorum holds a majority of the last one
      shrink_only=False,          # joiners admitted only at checkpoint steps
      join_window_s=0.0,          # joiners wait this long so a burst forms one quorum
      quorum_timeout_s=60.0))     # below quorum this long: stop (exit status 69)


def _method_settings(method: str, **settings: Any) -> ml_collections.ConfigDict:
  """`method`'s settings subtree (its defaults, then `settings`), with its name.

  A setting the method does not have is an error naming it (a misspelt setting would
  otherwise be ignored).
  """
  c = methods.method_defaults(method)
  unknown = sorted(set(settings) - set(c.keys()))
  if unknown:
    raise ValueError(f"method {method!r} has no setting {', '.join(map(repr, unknown))}; its "
                     f"settings: {', '.join(sorted(c.keys()))}.")
  c.name = method
  c.update(settings)
  return c


def with_method(config: ml_collections.ConfigDict, entry: dict) -> ml_collections.ConfigDict:
  """`config` with the method of an entry `{"method": name, **settings}` (the form of
  experiments/compare.py's METHODS), its optional "optimizer" overrides and "mesh".

  >>> c = with_method(base_config(), {"method": "diloco", "sync_every": 5, "mesh": "fsdp=8",
  ...                                 "optimizer": {"lr": 1e-3}})
  >>> c.method.name, c.method.sync_every, c.mesh, c.optimizer.lr
  ('diloco', 5, 'fsdp=8', 0.001)
  """
  entry = dict(entry)
  if "method" not in entry:
    raise ValueError(f"a method entry needs a 'method' (a name of experiments/methods/, a "
                     f"module path or a .py file), got {entry!r}.")
  optimizer = entry.pop("optimizer", {})
  mesh = entry.pop("mesh", None)
  c = config.copy_and_resolve_references()
  unknown = sorted(set(optimizer) - set(c.optimizer.keys()))
  if unknown:
    raise ValueError(f"config.optimizer has no setting {', '.join(map(repr, unknown))}; its "
                     f"settings: {', '.join(sorted(c.optimizer.keys()))}.")
  with c.unlocked():
    c.method = _method_settings(entry.pop("method"), **entry)
    c.optimizer.update(optimizer)
    if mesh is not None:
      c.mesh = mesh
  return c


def method_label(method: str) -> str:
  """A method's label: a name of experiments/methods/ itself, a module's or a file's last name.

  >>> method_label("diloco"), method_label("my.pkg.sparse_sync"), method_label("x/topk.py")
  ('diloco', 'sparse_sync', 'topk')
  """
  if method.endswith(".py"):
    return os.path.basename(method)[:-len(".py")]
  return method.rsplit(".", 1)[-1]


def resolve_methods(names: list | None, catalog: dict, *, first: str, known: dict | None = None,
                    setting: str = "--methods") -> dict:
  """{label: entry} to run, `first` (a `catalog` label: the reference) first.

  `names` (default: every label of `catalog`) are labels of `known` (default `catalog`), or
  a method of experiments/methods/, a dotted module path or a `.py` file (a plugin, labelled
  by `method_label`); anything else, or two different entries under one label, is an error
  naming `setting` and the allowed values.

  >>> resolve_methods(["diloco"], {"dp": {"method": "dp"}}, first="dp")
  {'dp': {'method': 'dp'}, 'diloco': {'method': 'diloco'}}
  """
  known = catalog if known is None else known
  if first not in catalog:
    raise ValueError(f"the reference {first!r} is not a method label; allowed: "
                     f"{', '.join(catalog)}.")
  chosen = {first: catalog[first]}
  for name in list(catalog) if names is None else list(names):
    if name in known:
      label, entry = name, known[name]
    elif name.endswith(".py") or "." in name or name in methods.available_methods():
      methods.load_method(name)  # a missing file or module fails here, naming it
      label, entry = method_label(name), {"method": name}
    else:
      raise ValueError(f"{setting}: {name!r} is unknown; allowed: {', '.join(known)}, a "
                       f"method of experiments/methods/ ({', '.join(methods.available_methods())}"
                       "), a dotted module path or a .py file.")
    if label in chosen and chosen[label] != entry:
      raise ValueError(f"{setting}: two methods are labelled {label!r}.")
    chosen[label] = entry
  return chosen


# ---------------------------------------------------------------- spec strings
def _literal(text: str) -> Any:
  """'8' -> 8, '0.5' -> 0.5, 'true' -> True, 'none' -> None, anything else stays text."""
  low = text.strip().lower()
  if low in ("none", "null"):
    return None
  if low in ("true", "false"):
    return low == "true"
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text.strip()


def parse_codec(spec: str | None, setting: str = "codec") -> Any:
  """A codec from its spec: `name` or `name:arg,key=value,...` with `name` a factory of
  `jaxcomm.codecs`; `none` (or empty) is None and `auto` stays "auto" (the method's default).

  >>> parse_codec("top_k:fraction=0.01").name
  'top_k(0.01)'
  >>> parse_codec("cast:bfloat16").name
  'cast(bfloat16)'
  """
  return "auto" if spec == "auto" else codecs.parse(spec, setting)


LINK_KEYS = ("gbit", "latency_ms")


def parse_link(spec: str, setting: str = "link") -> Any:
  """A network link (`jaxcomm.comm.Link`) from its spec: a preset name of
  `jaxcomm.comm.PRESETS` (`wan`, `internet`, ...), or a link of your own,
  `name:gbit=G,latency_ms=L` (G Gbit/s per direction, L ms per message).

  >>> parse_link("wan").latency
  0.03
  >>> link = parse_link("office:gbit=0.5,latency_ms=40")
  >>> link.name, link.bandwidth, link.latency
  ('office', 62500000.0, 0.04)
  """
  form = "name:gbit=G,latency_ms=L"
  text = spec.strip() if isinstance(spec, str) else ""
  name, colon, rest = text.partition(":")
  name = name.strip()
  if not colon:
    if name in comm.PRESETS:
      return comm.PRESETS[name]
    raise ValueError(f"{setting} {spec!r} is not a preset; allowed: "
                     f"{', '.join(comm.PRESETS)}, or a link of your own as {form}.")
  if not name or not all(ch.isalnum() or ch in "_-." for ch in name):
    raise ValueError(f"{setting} {spec!r}: the name before ':' must be letters, digits, "
                     f"'_', '-' or '.', got {name!r} (form {form}).")
  if name in comm.PRESETS:
    raise ValueError(f"{setting} {spec!r}: the name {name!r} is a preset's; give your link "
                     "another name.")
  values = {}
  for part in (p.strip() for p in rest.split(",")):
    key, eq, value = part.partition("=")
    key = key.strip()
    if not eq:
      raise ValueError(f"{setting} {spec!r}: part {part!r} must be key=value (form {form}).")
    if key not in LINK_KEYS:
      raise ValueError(f"{setting} {spec!r}: unknown key {key!r}; allowed: "
                       f"{', '.join(LINK_KEYS)}.")
    if key in values:
      raise ValueError(f"{setting} {spec!r}: {key} is given twice.")
    try:
      values[key] = float(value)
    except ValueError:
      raise ValueError(f"{setting} {spec!r}: {key} must be a number, got {value.strip()!r}."
                       ) from None
  missing = [k for k in LINK_KEYS if k not in values]
  if missing:
    raise ValueError(f"{setting} {spec!r}: missing {', '.join(missing)} (form {form}).")
  if not 0 < values["gbit"] < math.inf:
    raise ValueError(f"{setting} {spec!r}: gbit must be a finite number > 0, got "
                     f"{values['gbit']}.")
  if not 0 <= values["latency_ms"] < math.inf:
    raise ValueError(f"{setting} {spec!r}: latency_ms must be a finite number >= 0, got "
                     f"{values['latency_ms']}.")
  return comm.Link.gbit(values["gbit"], values["latency_ms"] / 1e3, name=name,
                        source=f"given on the command line: {text}")


def codec_names() -> list[str]:
  """The codec factories of `jaxcomm.codecs`: its public functions that return a Codec."""
  return codecs.names()


def participation_mask(spec: str | None, num_workers: int, num_syncs: int, seed: int = 0,
                       setting: str = "method.participation"):
  """A bool[num_syncs, W] mask from its spec, or None (every worker takes part).

  `drop:2,5@3,4` drops workers 2 and 5 at syncs 3 and 4 (`drop:2` at every sync;
  `drop:0@3;1@6` worker 0 at sync 3 and worker 1 at sync 6);
  `random:0.25` drops each worker with probability 0.25 at each sync (seeded; at least one
  worker stays live).

  >>> participation_mask("drop:1@0", 3, 2).astype(int).tolist()
  [[1, 0, 1], [1, 1, 1]]
  """
  if not spec:
    return None
  kind, _, arg = spec.partition(":")
  mask = np.ones((max(num_syncs, 1), num_workers), bool)
  if kind == "drop":
    for group in arg.split(";"):
      workers, _, syncs = group.partition("@")
      try:
        workers = [int(w) for w in workers.split(",")]
        syncs = [int(k) for k in syncs.split(",")] if syncs else list(range(len(mask)))
      except ValueError:
        raise ValueError(f"{setting} {spec!r}: expected drop:W1,W2@K1,K2.") from None
      if not all(0 <= w < num_workers for w in workers):
        raise ValueError(f"{setting} {spec!r}: workers must be in [0, {num_workers}).")
      for k in syncs:
        if 0 <= k < len(mask):
          mask[k, workers] = False
    return mask
  if kind == "random":
    try:
      rate = float(arg)
    except ValueError:
      rate = -1.0
    if not 0 <= rate < 1:
      raise ValueError(f"{setting} {spec!r}: the drop rate must be a number in [0, 1).")
    mask = np.random.default_rng(seed).random(mask.shape) >= rate
    mask[~mask.any(axis=1), 0] = True
    return mask
  raise ValueError(f"{setting} {spec!r} is unknown; allowed: drop:W1,W2@K1,K2 or "
                   "random:RATE.")


# ---------------------------------------------------------------- checks
def int_at_least(c, path: str, low: int) -> None:
  """config.<path> is an integer >= low, else a ValueError naming it."""
  value = _get(c, path)
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    raise ValueError(f"config.{path} must be an integer >= {low}, got {value!r}.")


def values_at_least(c, path: str, low: float, kind: type = numbers.Integral) -> tuple:
  """config.<path> is a non-empty tuple of `kind` (integers by default) >= low, else a
  ValueError naming it; returns the tuple (a sweep's values)."""
  values = _get(c, path)
  if not isinstance(values, tuple) or not values or not all(
      isinstance(v, kind) and not isinstance(v, bool) and v >= low for v in values):
    what = "integers" if kind is numbers.Integral else "numbers"
    raise ValueError(f"config.{path} must be a non-empty tuple of {what} >= {low} (written "
                     f"--config.{path}=1,2), got {values!r}.")
  return values


def names_in(c, path: str, allowed) -> list:
  """config.<path>: comma-separated names out of `allowed` ("": all of them, in order), else
  a ValueError naming the first unknown one and the allowed names."""
  names = [n for n in (_get(c, path) or "").split(",") if n] or list(allowed)
  unknown = [n for n in names if n not in allowed]
  if unknown:
    raise ValueError(f"config.{path}: {unknown[0]!r} is unknown; allowed: "
                     f"{', '.join(allowed)}.")
  return names


def _get(c, path: str) -> Any:
  for part in path.split("."):
    c = c[part]
  return c


def _one_of(c, path: str, allowed: tuple) -> None:
  value = _get(c, path)
  if value not in allowed:
    raise ValueError(f"config.{path} {value!r} is unknown; allowed: {', '.join(allowed)}.")


def number_in(c, path: str, low: float, high: float, low_open: bool, what: str) -> None:
  """A real number in [low, high) ((low, high) when low_open), else a ValueError."""
  value = _get(c, path)
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
     not (low < value if low_open else low <= value) or not value < high:
    raise ValueError(f"config.{path} must be {what}, got {value!r}.")


def check(c: ml_collections.ConfigDict) -> None:
  """Checks the settings every run shares (the method's own are checked by its factory).

  Raises:
    ValueError: naming the first setting that is out of range, with the allowed range.
  """
  for path, low in (("steps", 1), ("log_every", 1), ("checkpoint_every", 0), ("keep", 1),
                    ("seed", 0), ("data.batch_size", 1), ("data.seq_len", 1)):
    int_at_least(c, path, low)
  models.check(c.model)  # each model's module checks its own settings
  for path, allowed in (("data.pipeline", PIPELINES), ("data.split", SPLITS),
                        ("optimizer.name", OPTIMIZERS)):
    _one_of(c, path, allowed)
  for path, low, high, low_open, what in (
      ("optimizer.lr", 0, math.inf, True, "a finite number > 0"),
      ("optimizer.weight_decay", 0, math.inf, False, "a finite number >= 0"),
      ("data.label_skew", 0, math.inf, False, "0 (iid) or a Dirichlet alpha > 0")):
    number_in(c, path, low, high, low_open, what)
  if c.data.name.startswith("folder:") and c.data.pipeline != "grain":
    raise ValueError(f"config.data.name {c.data.name!r} (a folder of text files) is read by "
                     "the grain pipeline: set config.data.pipeline = 'grain'.")
  if not isinstance(c.mesh, str):
    raise ValueError(f"config.mesh must be text like 'data=8' or 'data=2,tensor=4', got "
                     f"{c.mesh!r}.")
  if "elastic" in c:
    check_elastic(c)
  if not isinstance(c.method.name, str) or not c.method.name:
    raise ValueError(f"config.method.name must name a method, got {c.method.name!r}.")


def min_workers(spec: str) -> Callable[[int], int]:
  """`step -> processes a round needs` from "N" or "N@T,...": N from step T on (until
  the next rule's step).

  >>> f = min_workers("2,3@40,1@50")
  >>> f(39), f(40), f(50)
  (2, 3, 1)
  """
  rules = []
  for rule in (r.strip() for r in str(spec).split(",") if r.strip()):
    n, _, t = rule.partition("@")
    if not (n.isdigit() and int(n) >= 1 and (not t or t.isdigit())):
      raise ValueError(f"config.elastic.min_workers must be 'N' or 'N@T,...' (N >= 1 "
                       f"processes from step T), got {spec!r}.")
    rules.append((int(t or 0), int(n)))
  rules.sort()
  return lambda step: ([n for t, n in rules if step >= t] or [1])[-1]


def check_elastic(c: ml_collections.ConfigDict) -> None:
  """Checks config.elastic (ValueError naming the setting)."""
  for path in ("elastic.heartbeat_timeout_s", "elastic.collective_timeout_s"):
    int_at_least(c, path, 1)
  for path in ("elastic.deadline_s", "elastic.join_window_s", "elastic.quorum_timeout_s"):
    number_in(c, path, 0, math.inf, False, "a finite number >= 0")
  min_workers(c.elastic.min_workers)


def to_dict(c: ml_collections.ConfigDict) -> dict:
  """The settings as plain JSON-able data (what a workdir's config.json holds)."""
  return c.to_dict()


def call(factory: Callable, settings: ml_collections.ConfigDict, **given: Any) -> Any:
  """`factory(**kwargs)` with every setting that names one of its parameters, then `given`
  (what the method module computes: the inner optimiser, axes, codecs from specs, ...).

  Passing settings by name, all of them, means a setting cannot be silently forgotten.
  """
  params = inspect.signature(factory).parameters
  kwargs = {k: settings[k] for k in settings.keys() if k in params and k not in given}
  return factory(**kwargs, **given)


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def differences(saved: dict, now: dict, ignore: tuple = ()) -> dict:
  """{setting path: (saved, now)} for every setting that differs between two configs' dicts.

  >>> differences({"a": 1, "m": {"h": 2}}, {"a": 1, "m": {"h": 3}})
  {'m.h': (2, 3)}
  """
  a, b = _flat(saved), _flat(now)
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
          if k not in ignore and a.get(k) != b.get(k)}


def define_config_flag(default: str, help_text: str):
  """`--config` for a program: `experiments._cli.config_flag` (one line for an override that
  names no setting; `--help` shows how overrides are written)."""
  # Lazy: _cli defines --verbose on import; only a program that takes --config wants it.
  from experiments import _cli
  return _cli.config_flag(default, help_text)
