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

A method's settings are *read* from its library factory's signature
(`experiments.toolkit.from_factory`), so a default lives in one place, the factory; a config
file only sets what an experiment chooses. Codecs are spec strings in one vocabulary, the
factory names of `jaxcomm.codecs` (`experiments.specs.parse_codec`). Files in
`experiments/configs/` return such trees from `get_config()`, and `python -m experiments.train
--config=experiments/configs/diloco.py --config.method.sync_every=50` overrides any field,
typed (ml_collections checks the type).

Bad settings fail here, before anything compiles, with a one-line ValueError that names the
setting (`check`).
"""

from __future__ import annotations

import difflib
import os
from typing import Any

import ml_collections

from . import methods, models, specs, toolkit

PIPELINES = ("numpy", "grain")
OPTIMIZERS = ("adamw", "adam", "sgd", "momentum")
# The inner optimiser's learning-rate schedule (experiments.compare's compare.schedule,
# copied to optimizer.schedule; build.py makes the inner optimiser schedule-free, or gives
# it a warmup-stable-decay rate).
SCHEDULES = ("constant", "schedule_free", "wsd")
SPLITS = ("all", "train", "test")


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
  c.method = methods.settings(method, **method_settings)
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


def with_method(config: ml_collections.ConfigDict, entry: dict) -> ml_collections.ConfigDict:
  """`config` with the method of an entry `{"method": name, **settings}` (the form of
  experiments.compare's METHODS), its optional "optimizer" overrides and "mesh".

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
    c.method = methods.settings(entry.pop("method"), **entry)
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
      raise ValueError(f"{setting} must be one of {', '.join(map(repr, known))}, a method of "
                       f"experiments/methods/ ({', '.join(methods.available_methods())}), a "
                       f"dotted module path or a .py file; got {name!r}.")
    if label in chosen and chosen[label] != entry:
      raise ValueError(f"{setting}: two methods are labelled {label!r}.")
    chosen[label] = entry
  return chosen


def with_settings(entries: dict, given: dict | None) -> dict:
  """`entries` ({label: entry}, as `resolve_methods` gives) with the method settings `given`
  on the command line (`--config.method.<setting>`) set in every entry whose method has
  them: how a program that runs several methods takes method settings. A setting that none
  of the methods has is an error naming it (with the closest setting they have).

  >>> with_settings({"dp": {"method": "dp"}, "h10": {"method": "diloco", "sync_every": 10}},
  ...               {"sync_every": 50})
  {'dp': {'method': 'dp'}, 'h10': {'method': 'diloco', 'sync_every': 50}}
  """
  if not given:
    return entries
  out, known = {}, set()
  for label, entry in entries.items():
    own = methods.method_defaults(entry["method"]).keys()
    known.update(own)
    out[label] = {**entry, **{k: v for k, v in given.items() if k in own}}
  unknown = sorted(set(given) - known)
  if unknown:
    close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
    raise ValueError(f"--config.method.{unknown[0]}: none of the methods run "
                     f"({', '.join(entries)}) has this setting"
                     f"{f'; did you mean {close[0]!r}?' if close else '.'}")
  return out


# ---------------------------------------------------------------- checks
def check(c: ml_collections.ConfigDict) -> None:
  """Checks the settings every run shares (the method's own are checked by its factory).

  Raises:
    ValueError: naming the first setting that is out of range, with the allowed range.
  """
  for path, low in (("steps", 1), ("log_every", 1), ("checkpoint_every", 0), ("keep", 1),
                    ("seed", 0), ("data.batch_size", 1), ("data.seq_len", 1)):
    toolkit.int_at_least(c, path, low)
  models.check(c.model)  # each model's module checks its own settings
  for path, allowed in (("data.pipeline", PIPELINES), ("data.split", SPLITS),
                        ("optimizer.name", OPTIMIZERS)):
    toolkit.one_of(c, path, allowed)
  toolkit.number_in(c, "optimizer.lr", 0, low_open=True)
  toolkit.number_in(c, "optimizer.weight_decay", 0)
  toolkit.number_in(c, "data.label_skew", 0)  # 0: iid, else a Dirichlet alpha
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


def check_elastic(c: ml_collections.ConfigDict) -> None:
  """Checks config.elastic (ValueError naming the setting)."""
  for path in ("elastic.heartbeat_timeout_s", "elastic.collective_timeout_s"):
    toolkit.int_at_least(c, path, 1)
  for path in ("elastic.deadline_s", "elastic.join_window_s", "elastic.quorum_timeout_s"):
    toolkit.number_in(c, path, 0)
  specs.min_workers(c.elastic.min_workers)


def to_dict(c: ml_collections.ConfigDict) -> dict:
  """The settings as plain JSON-able data (what a workdir's config.json holds)."""
  return c.to_dict()


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


def define_config_flag(default: str, help_text: str, *, several: bool = False):
  """`--config` for a program: `experiments._cli.config_flag` (one line for an override that
  names no setting; `--help` shows how overrides are written; `several`: the program runs
  several methods and takes the settings of all of them)."""
  # Lazy: _cli defines --verbose on import; only a program that takes --config wants it.
  from . import _cli
  return _cli.config_flag(default, help_text, several=several)
