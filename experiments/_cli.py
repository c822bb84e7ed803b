"""How every program of experiments/ meets its user: one line per mistake, quiet logs, help.

train.py, plan.py, compare.py and the reproductions start with `run(main)` instead of
`absl.app.run(main)`, and define `--config` with `config_flag`:

* a mistake in a flag or a setting (an unknown setting, with ml_collections' "Did you mean";
  a value of the wrong type; a config file or `default.py:NAME` that does not load; a value
  out of range, a ValueError raised before anything is written) ends the program with ONE
  line, `error: <what, naming the flag or setting>`, on stderr and exit status 1;
* `--verbose` shows INFO logging (Orbax's checkpoint messages, absl's) and, for a mistake,
  the traceback too; without it only warnings and errors are logged;
* `--help` lists `--config` and `--verbose` with the program's own flags, under the
  program's docstring (which shows how `--config.<path>=<value>` overrides are written).
"""

from __future__ import annotations

import re
import sys
from typing import Callable, NoReturn

from absl import app, flags, logging
from ml_collections import config_flags

VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Log at INFO level (Orbax checkpointing, absl) and show tracebacks of "
    "errors; otherwise warnings and errors only, and a mistake is one line.")
OVERRIDES = ("Override any setting of the config with --config.<path>=<value>, typed, e.g. "
             "--config.steps=500 --config.method.sync_every=50 --config.mesh=replica=2,fsdp=4 "
             "(a path that names no setting is an error).")
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


def config_flag(default: str, help_text: str, flag_values=flags.FLAGS):
  """`--config` (`ml_collections.config_flags`, locked: an override must name an existing
  setting), listed by `--help` with how overrides are written. config_flags reads the
  command line's `--config.<path>` overrides when the flag is defined: a path that names no
  setting ends the program here, as one line (with ml_collections' "Did you mean")."""
  try:
    holder = config_flags.DEFINE_config_file("config", default, f"{help_text} {OVERRIDES}",
                                             flag_values=flag_values, lock_config=True)
  except (AttributeError, KeyError) as e:
    _no_such_setting(e)
  return holder


def _no_such_setting(e: Exception) -> NoReturn:
  """ml_collections' error for an override naming no setting (with its "Did you mean")."""
  overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
  why = str(e.args[0] if e.args else e).replace("\\n", " ").replace("\\'", "'")
  name, _, hint = why.strip("'\"").partition("'")
  wrong = [a for a in overrides if re.search(rf"\.{re.escape(name)}(=|$)", a)] or overrides
  fail(f"{' '.join(wrong)}: no such setting {name!r}.{' ' + hint.strip() if hint else ''}")


def parse_flags(argv: list, flag_values=flags.FLAGS) -> list:
  """absl's flags parser, with a mistake as one line naming the flag (`run` uses it)."""
  try:
    return flag_values(argv)
  except flags.Error as e:
    fail(e)
  except (AttributeError, KeyError) as e:  # an override below a config file's method
    _no_such_setting(e)


def _key_flags() -> None:
  """`--config` and `--verbose` are listed by the program's `--help` (its key flags)."""
  for name in ("config", "verbose"):
    if name in flags.FLAGS:
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def run(main: Callable) -> None:
  """`absl.app.run(main)` with one-line errors and quiet logs (see the module docstring).

  A ValueError out of `main` is a user's mistake (every setting is checked before anything
  compiles or is written): one line, exit status 1; with `--verbose`, its traceback.
  """
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


__all__ = ["VERBOSE", "config_flag", "fail", "one_line", "parse_flags", "run"]
