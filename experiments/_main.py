"""`jaxcomm PROGRAM [FLAGS]`: the programs of experiments/ as one command (console script).

`jaxcomm train --config=diloco --config.method.sync_every=20` is `python -m
experiments.train ...` in a checkout and `python -m jaxcomm.experiments.train ...` where the
wheel is installed: the same program, run as its own `__main__`, so every flag, config name
and error reads as the README shows it. `jaxcomm` alone (or `--help`) lists the programs;
`jaxcomm PROGRAM --help` shows one program's flags.
"""

from __future__ import annotations

import difflib
import runpy
import sys

# program -> what it does (one line of `jaxcomm --help`)
PROGRAMS = {
    "train": "train one method (a config file and --config.<path> overrides)",
    "compare": "which method reaches the held-out loss first on each link",
    "plan": "plan methods at real model sizes, compiled but never allocated",
    "launch_local": "start N local processes of a program as one multi-host run",
    "compression_table": "floats sent per step of every compressor, from compiled programs",
    "heterogeneous": "loss against simulated time on workers of unequal speed",
    "replica_periods": "one sync period for all replicas against one per replica",
    "elastic_goodput": "goodput under a failure: elastic against restarting from a checkpoint",
    "reproduce.diloco": "DiLoCo (arXiv 2311.08105): loss against H and the workers",
    "reproduce.powersgd": "PowerSGD (arXiv 1905.13727): loss and bytes against the rank",
    "reproduce.topk": "top-k sparsification with and without memory",
    "reproduce.demo": "DeMo (arXiv 2411.19870)",
    "reproduce.streaming": "Streaming DiLoCo (arXiv 2501.18512)",
}


def usage() -> str:
  width = max(map(len, PROGRAMS))
  lines = [f"  {name:<{width}}  {what}" for name, what in PROGRAMS.items()]
  return ("usage: jaxcomm PROGRAM [FLAGS]   (jaxcomm PROGRAM --help: its flags)\n\nprograms:\n"
          + "\n".join(lines))


def main(argv: list[str] | None = None) -> None:
  """Runs `jaxcomm PROGRAM [FLAGS]` (`argv` default: sys.argv)."""
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    print(usage())
    sys.exit(0 if len(argv) > 1 else 1)
  program = argv[1].replace("-", "_").replace("reproduce_", "reproduce.")
  if program not in PROGRAMS:
    close = difflib.get_close_matches(program, list(PROGRAMS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    sys.exit(f"error: jaxcomm: no program {argv[1]!r}; the programs: "
             f"{', '.join(PROGRAMS)}.{hint}")
  sys.argv = [f"jaxcomm {program}", *argv[2:]]
  runpy.run_module(f"{__package__}.{program}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
