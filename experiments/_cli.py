"""How every program of experiments/ meets its user: one line per mistake, quiet logs, help.

train.py, plan.py, compare.py and the reproductions start with `run(main)` instead of
`absl.app.run(main)`, and define `--config` with `config_flag` (a config file of
experiments/configs/); the studies and benchmarks start with `run(main, get_config(),
workdir=...)`, whose `--config` holds the program's own settings (`settings_flag`):

* a mistake in a flag or a setting (an unknown setting, with ml_collections' "Did you mean";
  a value of the wrong type; a config file or `default.py:NAME` that does not load; a value
  out of range, a ValueError raised before anything is written) ends the program with ONE
  line, `error: <what, naming the flag or setting>`, on stderr and exit status 1;
* `--verbose` shows INFO logging (Orbax's checkpoint messages, absl's) and, for a mistake,
  the traceback too; without it only warnings and errors are logged;
* `--help` lists `--config` (with a program's own settings and their defaults) and
  `--verbose` with the program's own flags, under the program's docstring (which shows how
  `--config.<path>=<value>` overrides are written).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Callable, NoReturn

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Log at INFO level (Orbax checkpointing, absl) and show tracebacks of "
    "errors; otherwise warnings and errors only, and a mistake is one line.")
OVERRIDES = ("Override any setting of the config with --config.<path>=<value>, typed, e.g. "
             "--config.steps=500 --config.method.name=diloco --config.method.sync_every=50 "
             "--config.mesh=replica=2,fsdp=4 (a path that names no setting is an error; "
             "--config.method.name selects a method and brings its settings). --config is a "
             "file, or a shipped config by name: diloco, default.py:NAME, reproduce/diloco.")
SETTING_OVERRIDES = ("Override a setting with --config.<path>=<value>, typed; a tuple as "
                     "--config.<path>=1,2 (a path that names no setting is an error).")
_TRACEBACK = "Traceback (most recent call last)"


def one_line(message: object) -> str:
  """An error's message as one line: a traceback inside it (ml_collections puts the config
  file's traceback into its flag error) becomes its last line, the exception itself.

  >>> one_line("flag --config=x.py: Error whilst parsing config file:\\n\\nTraceback "
  ...          "(most recent call last):\\n  File ...\\nValueError: config.method.name 'x' is "
  ...          "unknown")
  "flag --config=x.py: Error whilst parsing config file: config.method.name 'x' is unknown"
  """
  text = str(message)
  if _TRACEBACK in text:
    head, _, tail = text.partition(_TRACEBACK)
    last = [line for line in tail.splitlines() if line.strip()][-1].strip()
    last = re.sub(r"^[\w.]*(Error|Exception): ", "", last)
    text = f"{head.rstrip().rstrip(':')}: {last}"
  return " ".join(text.replace("\\n", " ").split())


def fail(message: object) -> NoReturn:
  """Ends the program: `error: <message as one line>` on stderr, exit status 1."""
  sys.exit(f"error: {one_line(message)}")


def config_flag(default: str, help_text: str, flag_values=flags.FLAGS,
                overrides: str = OVERRIDES, *, several: bool | tuple = False):
  """`--config` (`ml_collections.config_flags`, locked: an override must name an existing
  setting), listed by `--help` with how overrides are written. Its value is a config file's
  path or a shipped config's name, and `--config.method.name` selects the method whose
  settings the other `--config.method.<setting>` overrides set (experiments/_config_file.py;
  `several`: a program that runs several methods takes the settings of all of them, of
  every method (True) or of those named).
  config_flags reads the command line's `--config.<path>` overrides when the flag is
  defined: a path that names no setting ends the program here, as one line (with
  ml_collections' "Did you mean")."""
  from . import _config_file  # lazy: it loads the methods (jax, optax) for --config only

  def define(name, default, help_string, flag_values, lock_config):
    # DEFINE_config_file with this package's parser: config_flags builds its flag so.
    flag = _config_file.config_flags._ConfigFlag(
        parser=_config_file.ConfigFile(name, lock_config, several),
        serializer=flags.ArgumentSerializer(), name=name, default=default,
        help_string=help_string, flag_values=flag_values)
    return flags.DEFINE_flag(flag, flag_values)
  return _define(define, default, f"{help_text} {overrides}", flag_values)


def settings_flag(defaults: ml_collections.ConfigDict, help_text: str,
                  flag_values=flags.FLAGS):
  """`--config` holding a program's own settings (`defaults`, its `get_config()`), each
  overridable as `--config.<path>=<value>`; `--help` lists them with their defaults."""
  text = f"{help_text} Settings: {settings(defaults)}. {SETTING_OVERRIDES}"
  return _define(config_flags.DEFINE_config_dict, defaults, text, flag_values)


def program_flags(defaults: ml_collections.ConfigDict, help_text: str = "The program's settings.",
                  *, workdir: str | None = None, devices: int | None = None, out: bool = False,
                  flag_values=flags.FLAGS):
  """A study's or benchmark's command line: `--config` holding its own settings
  (`settings_flag`), and, where the program takes them, `--workdir` (this default) and
  `--devices` (emulated CPU devices, this default), as train.py takes them, or `--out` (an
  optional JSON file of the results, `write_json`). Returns the config's flag holder; call
  it under `if __name__ == "__main__"` (importing the program then defines nothing)."""
  holder = settings_flag(defaults, help_text, flag_values)
  if workdir is not None:
    flags.DEFINE_string("workdir", workdir, "Where the results go.", flag_values=flag_values)
  if devices is not None:
    flags.DEFINE_integer("devices", devices, "Emulated CPU devices.", lower_bound=1,
                         flag_values=flag_values)
  if out:
    flags.DEFINE_string("out", None, "Optional JSON output path.", flag_values=flag_values)
  return holder


def method_settings(config: ml_collections.ConfigDict, argv: list | None = None) -> dict:
  """{setting: value} of config.method that the command line (`argv`, default sys.argv) set,
  `name` left out: what a program running several methods sets in each of them that has
  the setting."""
  from . import _config_file  # lazy, as in config_flag
  return _config_file.method_settings(config, argv)


def write_json(path: str | None, value) -> None:
  """Writes `value` as JSON to `path` (its folder made), when a path is given (`--out`)."""
  if path:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(value, f, indent=1)


def _define(define: Callable, default, help_text: str, flag_values):
  try:
    return define("config", default, help_text, flag_values=flag_values, lock_config=True)
  except (AttributeError, KeyError) as e:
    _no_such_setting(e)
  except flags.Error as e:  # the default config, loaded here when --config is not given
    fail(e)


def settings(c: ml_collections.ConfigDict, prefix: str = "") -> str:
  """Every leaf of `c` as `path=value`, for `--help`.

  >>> settings(ml_collections.ConfigDict(dict(steps=5, sweep=dict(hs=(1, 2)))))
  'steps=5, sweep.hs=1,2'
  """
  out = []
  for key in c.keys():
    value = c[key]
    if isinstance(value, ml_collections.ConfigDict):
      out.append(settings(value, f"{prefix}{key}."))
    else:
      shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
      out.append(f"{prefix}{key}={shown}")
  return ", ".join(out)


def _no_such_setting(e: Exception) -> NoReturn:
  """ml_collections' error for an override naming no setting (with its "Did you mean")."""
  overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
  why = str(e.args[0] if e.args else e).replace("\\n", " ").replace("\\'", "'")
  name, _, hint = why.strip("'\"").partition("'")
  wrong = [a for a in overrides if re.search(rf"\.{re.escape(name)}(=|$)", a)] or overrides
  fail(f"{' '.join(wrong)}: no such setting {name!r}.{' ' + hint.strip() if hint else ''}"
       f"{_method_hint(wrong, name)}")


def _method_hint(wrong: list, name: str) -> str:
  """For a `--config.method.<name>` override: how to select a method that has the setting."""
  if not any(a.startswith("--config.method.") for a in wrong):
    return ""
  from . import _config_file  # lazy, as in config_flag
  having = _config_file.methods_with(name)
  if not having:
    return ""
  return (f" A method's settings come with its name: select it with --config.method.name=NAME "
          f"(NAME with setting {name!r}: {', '.join(having)}).")


def parse_flags(argv: list, flag_values=flags.FLAGS) -> list:
  """absl's flags parser, with a mistake as one line naming the flag (`run` uses it)."""
  try:
    return flag_values(argv)
  except flags.Error as e:
    fail(e)
  except (AttributeError, KeyError) as e:  # an override below a config file's method
    _no_such_setting(e)


def _key_flags() -> None:
  """`--config`, `--verbose` (and `--workdir`, `--devices`, `--out` where a helper here or
  in experiments/reproduce/_reproduce.py defined them) are listed by the program's `--help`."""
  for name in ("config", "verbose", "workdir", "devices", "out"):
    if name in flags.FLAGS:
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def run(main: Callable, defaults: ml_collections.ConfigDict | None = None, **program) -> None:
  """`absl.app.run(main)` with one-line errors and quiet logs (see the module docstring).

  A ValueError out of `main` is a user's mistake (every setting is checked before anything
  compiles or is written): one line, exit status 1; with `--verbose`, its traceback. With
  `defaults` (a study's or benchmark's `get_config()`), `program_flags(defaults, **program)`
  defines its command line first (`main` reads `flags.FLAGS.config`).
  """
  if defaults is not None:
    program_flags(defaults, **program)

  def wrapped(argv):
    logging.set_verbosity(logging.INFO if VERBOSE.value else logging.WARNING)
    try:
      return main(argv)
    except ValueError as e:
      if VERBOSE.value:
        raise
      fail(e)

  _key_flags()
  app.run(wrapped, flags_parser=parse_flags)


__all__ = ["VERBOSE", "config_flag", "fail", "one_line", "parse_flags", "program_flags", "run",
           "settings", "settings_flag", "write_json"]
