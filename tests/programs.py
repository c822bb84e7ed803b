"""Running a program of experiments/ in-process (tests/test_program_flags.py, and the wheel's
own check in tests/test_wheel.py, where the package is `jaxcomm.experiments`): its flags on a
fresh FlagValues, its `main` with the heavy steps replaced by a sentinel.

A program is run as its own `__main__` (runpy). In the sandbox a build, a jitted call and a
process start are `Reached` (the program got past its checks), the device count a program
asks for is what it gets (emulated), and a command's outcome is "ok", one line
"error: ...", or "TRACEBACK ..." for anything a user would see as a traceback.
"""

import functools
import importlib
import runpy
import signal
import subprocess
import sys
import textwrap

import jax
import pytest
from absl import flags

_DEFINES = ("DEFINE_string", "DEFINE_integer", "DEFINE_float", "DEFINE_bool",
            "DEFINE_boolean", "DEFINE_list", "DEFINE_enum", "DEFINE_multi_string")


MY_METHOD = textwrap.dedent('''
    import ml_collections, optax
    def defaults():
      return ml_collections.ConfigDict({"clip": 1.0})
    def build(settings, ctx):
      return optax.identity()
    ''')


class Reached(Exception):
  """The program got past its checks to a compile, a jitted call or a process start."""


class _Unjitted:
  """What `jax.jit` returns in these tests: calling, lowering or tracing it is `Reached`."""

  def __init__(self, fn=None, **_):
    self.fn = fn

  def __call__(self, *args, **kwargs):
    if self.fn is None:  # jax.jit(**options) used as a decorator factory
      return _Unjitted(args[0])
    raise Reached("jit")

  def __getattr__(self, name):
    raise Reached(f"jit.{name}")


class Program:
  """A program's flags on a fresh FlagValues and its `main` (not yet called); `close()`
  undoes what defining them patched."""

  def __init__(self, name: str, argv: list, package: str = "experiments"):
    cli = importlib.import_module(f"{package}._cli")
    self.mp = mp = pytest.MonkeyPatch()
    self.fv = fv = flags.FlagValues()
    for define in _DEFINES:
      mp.setattr(flags, define, functools.partial(getattr(flags, define), flag_values=fv))
    mp.setattr(flags, "FLAGS", fv)  # programs that read flags.FLAGS.<name>
    config_flag = cli.config_flag
    mp.setattr(cli, "config_flag", lambda default, text, flag_values=None, *a, **k:
               config_flag(default, text, fv, *a, **k))
    captured = {}

    def run(main, defaults=None, **program):
      captured["main"] = main
      if defaults is not None:
        cli.program_flags(defaults, flag_values=fv, **program)

    mp.setattr(cli, "run", run)
    mp.setattr(sys, "argv", [f"jaxcomm {name}", *argv])
    flags.DEFINE_bool("verbose", False, "as _cli's")
    try:
      runpy.run_module(f"{package}.{name}", run_name="__main__")
    except BaseException:
      mp.undo()
      raise
    self.main = captured["main"]
    self.cli = cli

  def parse(self) -> list:
    return self.cli.parse_flags(sys.argv, self.fv)

  def close(self):
    self.mp.undo()


def sandbox_patches(monkeypatch, package: str = "experiments"):
  """No build, compile or process start; the device count a program asks for is what it
  gets (emulated)."""
  for name in importlib.import_module(f"{package}._main").PROGRAMS:
    importlib.import_module(f"{package}.{name}")  # before flags.FLAGS is swapped (read at import)
  build = importlib.import_module(f"{package}.build")
  monkeypatch.setattr(jax, "jit", _Unjitted)
  monkeypatch.setattr(build, "build", lambda *a, **k: (_ for _ in ()).throw(Reached("build")))
  real = jax.devices()
  devices = {"n": len(real)}
  update = jax.config.update

  def config_update(name, value):
    if name == "jax_num_cpu_devices":
      if value < 1:  # what JAX does at the first operation
        raise RuntimeError("Unable to initialize backend 'cpu': INVALID_ARGUMENT (emulated)")
      devices["n"] = value
      return None
    if name in ("jax_platforms", "jax_compilation_cache_dir",
                "jax_persistent_cache_min_compile_time_secs"):
      return None
    return update(name, value)

  monkeypatch.setattr(jax.config, "update", config_update)
  monkeypatch.setattr(jax, "device_count", lambda *a: devices["n"])
  monkeypatch.setattr(jax, "devices", lambda *a: [real[i % len(real)]
                                                  for i in range(devices["n"])])
  for name in ("Popen", "run"):
    monkeypatch.setattr(subprocess, name, lambda *a, **k: (_ for _ in ()).throw(
        Reached("process")))
  return monkeypatch


def outcome(name: str, argv: list, seconds: float = 20.0, package: str = "experiments") -> str:
  """How `jaxcomm <name> <argv>` ends in the sandbox: "ok" (it ran, or reached a build,
  compile or process start), "error: ..." (one line), or "TRACEBACK ..." (anything else)."""
  def alarm(signum, frame):
    raise Reached("time")

  previous = signal.signal(signal.SIGALRM, alarm)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  program = None
  try:
    program = Program(name, argv, package)
    program.main(program.parse())
    return "ok"
  except Reached:
    return "ok"
  except SystemExit as e:
    text = "ok" if e.code in (None, 0) else str(e.code)
    return text if text == "ok" or (text.startswith("error: ") and "\n" not in text) else \
        f"TRACEBACK exit {text[:300]!r}"
  except ValueError as e:  # `_cli.run` prints it as one line
    return "error: " + " ".join(str(e).split())
  except Exception as e:  # anything else is a traceback for the user
    return f"TRACEBACK {type(e).__name__}: {str(e)[:300]}"
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
    if program is not None:
      program.close()




def check_commands(package: str, commands: list) -> list:
  """(program, argv, outcome) of every `commands` item (program, argv) that is not "ok",
  each parsed and run in the sandbox with the programs of `package`."""
  mp = pytest.MonkeyPatch()
  try:
    sandbox_patches(mp, package)
    return [(name, argv, r) for name, argv in commands
            if (r := outcome(name, argv, package=package)) != "ok"]
  finally:
    mp.undo()
