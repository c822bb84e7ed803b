"""`--config`'s value: a config file, found by path or by name, loaded, its method selected.

* A value is `FILE` or `FILE:ARG` (`ARG` goes to `get_config`). `FILE` is a path, or names a
  config that ships in experiments/configs/: `diloco`, `diloco.py`, `reproduce/diloco`, or
  `experiments/configs/diloco.py` as the README writes it, so the same command works in a
  checkout and from an installed wheel. A shipped config is imported as a module of this
  package (its relative imports work under either name); a file of your own is loaded by
  path.
* `--config.method.name=NAME` on the command line selects method NAME: config.method
  becomes NAME's settings (the config file's values kept when it names the same method),
  so `--config.method.<setting>` overrides of NAME's settings follow it.
* A program that runs several methods takes their settings as `--config.method.<setting>`
  (`method_settings` reads which were given): compare and plan those of every shipped method
  and of the method files and module paths their `--methods` names, a reproduction those of
  the methods it runs.

Every mistake is a ValueError of one line (the caller adds the flag's name).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys

import ml_collections
from ml_collections import config_dict
from ml_collections.config_flags import config_flags  # its parser class is not re-exported

from . import methods

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def shipped() -> list[str]:
  """The run configs of experiments/configs/ by name (`diloco`, `reproduce/diloco`, ...;
  the planner's model presets of configs/models/ are not run configs)."""
  out = []
  for folder, _, files in os.walk(CONFIGS):
    rel = os.path.relpath(folder, CONFIGS)
    out += [os.path.normpath(os.path.join(rel, f[:-3])) for f in files
            if f.endswith(".py") and not f.startswith("_") and rel != "models"]
  return sorted(out)


def methods_with(setting: str) -> list[str]:
  """The shipped methods that have `setting`.

  >>> methods_with("outer_momentum")
  ['diloco', 'muloco', 'streaming_diloco']
  """
  return [m for m in methods.available_methods() if setting in methods.method_defaults(m)]


def find(path: str) -> str:
  """The file a `--config` value's FILE part names: the path itself when it exists, else
  a shipped config by name (see the module docstring).

  >>> os.path.relpath(find("diloco"), CONFIGS), os.path.relpath(find("reproduce/topk.py"),
  ...                                                           CONFIGS)
  ('diloco.py', 'reproduce/topk.py')
  """
  if os.path.isfile(path):
    return path
  name = path.replace(os.sep, "/")
  name = name.split("experiments/configs/", 1)[-1]
  name = name[:-3] if name.endswith(".py") else name
  candidate = os.path.join(CONFIGS, *name.split("/")) + ".py"
  if name and os.path.isfile(candidate) and not os.path.basename(name).startswith("_"):
    return candidate
  raise ValueError(f"no such config file {path!r}: give the path of a get_config() file, or "
                   f"the name of a shipped config: {', '.join(shipped())}.")


def load(value: str) -> ml_collections.ConfigDict:
  """The config a `--config` value gives: `get_config(ARG)` of its file."""
  path, colon, arg = str(value).partition(":")
  file = os.path.realpath(find(path))
  if file.startswith(os.path.realpath(CONFIGS) + os.sep):
    rel = os.path.relpath(file, os.path.realpath(CONFIGS))[:-3].replace(os.sep, ".")
    module = importlib.import_module(f"{__package__}.configs.{rel}")
  else:  # a file of your own
    spec = importlib.util.spec_from_file_location(
        f"config_file_{re.sub(r'[^0-9A-Za-z_]', '_', path)}", file)
    module = importlib.util.module_from_spec(spec)
    try:
      spec.loader.exec_module(module)
    except Exception as e:  # any mistake in it is one line
      raise ValueError(f"config file {path!r} does not load: {type(e).__name__}: {e}") from e
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"config file {path!r} defines no get_config().")
  return module.get_config(*([arg] if colon else []))


def argv_value(argv: list, name: str) -> str | None:
  """The last value of flag `--name` in `argv` (`--name=V` or `--name V`), or None.

  >>> argv_value(["p", "--a=1", "--config.method.name", "diloco"], "config.method.name")
  'diloco'
  """
  found = None
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      found = arg.split("=", 1)[1]
    elif arg == f"--{name}" and i + 1 < len(argv):
      found = argv[i + 1]
  return found


def given_settings(argv: list, prefix: str = "config.method.") -> list[str]:
  """The settings under `prefix` that `argv` overrides (their names, `name` left out)."""
  names = [a[2:].split("=", 1)[0][len(prefix):] for a in argv if a.startswith(f"--{prefix}")]
  return [n for n in dict.fromkeys(names) if n and n != "name" and "." not in n]


def method_settings(config: ml_collections.ConfigDict, argv: list | None = None) -> dict:
  """{setting: value} of config.method that the command line set (`name` left out): what a
  program running several methods applies to each of them that has the setting."""
  argv = sys.argv if argv is None else argv
  return {n: config.method[n] for n in given_settings(argv) if n in config.method}


class ConfigFile(config_flags.ConfigFileFlagParser):
  """ml_collections' config-file parser, with names, the method selected by
  `--config.method.name` and, for a program of several methods (`several`: True for every
  method and those `--methods` names, or the names of the methods it runs), the settings of
  all of them."""

  def __init__(self, name: str, lock_config: bool = True, several: bool | tuple = False):
    super().__init__(name, lock_config)
    self._several = several

  def parse(self, value):
    config = load(value)
    argv = sys.argv
    if isinstance(config, ml_collections.ConfigDict) and "method" in config:
      with config.unlocked():
        name = argv_value(argv, f"{self.name}.method.name")
        if name is not None and name != config.method.get("name"):
          config.method = methods.settings(name)
        if self._several:
          _add_settings(config.method, list(self._several) if isinstance(
              self._several, (tuple, list)) else _methods_of(argv))
    if self._lock_config:
      config.lock()
    return config


def _methods_of(argv: list) -> list[str]:
  """The shipped methods and the files and module paths that `--methods` names."""
  named = [m for m in (argv_value(argv, "methods") or "").split(",")
           if m.endswith(".py") or "." in m]
  return methods.available_methods() + named


def _add_settings(method: ml_collections.ConfigDict, names: list[str]) -> None:
  """Every setting of the methods `names` that `method` lacks, as a placeholder of its type
  (None unless the command line sets it)."""
  for name in names:
    try:
      defaults = methods.method_defaults(name)
    except ValueError:
      continue  # a --methods entry that does not load: the program names it, as --methods
    for key in defaults.keys():
      if key not in method:
        setattr(method, key, config_dict.placeholder(defaults.get_type(key)))
