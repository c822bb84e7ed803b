"""`python -m experiments.compare`: the comparison's command line (its `--help` shows the
package's docstring, the protocol)."""

from __future__ import annotations

import os
import sys

import jax
from absl import flags

from .. import _cli
from .. import compare
from .. import config as _config
from . import settings as settings_

__doc__ = compare.__doc__  # absl's --help shows the main module's docstring: the protocol

_WORKDIR = flags.DEFINE_string("workdir", "runs/compare", "Where the report, results and "
                               "plots go.")
_METHODS = flags.DEFINE_list(
    "methods", None, "Methods to compare (default: all of METHODS): METHODS labels, method "
    "names of experiments/methods/, dotted module paths or .py files of your own.")
_LINKS = flags.DEFINE_list("links", None, "Link presets (jaxcomm.comm.PRESETS) to time on; "
                           "default: config.compare.links.")
_LINK = flags.DEFINE_multi_string("link", [], "A link of your own, added to the others: "
                                  "name:gbit=G,latency_ms=L (repeatable).")
_BUDGET = flags.DEFINE_float("budget", None, "Each link's time budget as a multiple of the "
                             "reference's median time to the target there (default: "
                             "config.compare.budget).")
_RULESET = flags.DEFINE_enum("ruleset", None, list(settings_.RULESETS), "default: each method's "
                             "settings, S seeds; tuned: each method module's tuning() list, "
                             "S studies (default: config.compare.ruleset).")
_SEEDS = flags.DEFINE_integer("seeds", None, "Seeds (studies) S (default: "
                              "config.compare.seeds).")
_TARGET = flags.DEFINE_float("target_loss", None, "The held-out loss to reach (default: "
                             "the reference's, see the module docstring).")
_MAX_STEPS = flags.DEFINE_integer("max_steps", None, "The most inner steps any method trains "
                                  "(default: config.compare.max_steps).")
_CONFIG = _config.define_config_flag(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                 "compare.py"),
    "What every method shares (model, data, optimizer, the reference's steps) and how "
    "results are read (config.compare); `configs/compare.py:long` for the longer run. "
    "--config.method.<setting> sets that setting in every method compared that has it.",
    several=True)
_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices.", lower_bound=1)


def main(argv):
  del argv
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  config = settings_.with_flags(_CONFIG.value, _LINKS.value, _LINK.value, _BUDGET.value,
                                _MAX_STEPS.value, ruleset=_RULESET.value, seeds=_SEEDS.value,
                                target_loss=_TARGET.value)
  compare.run(config, _WORKDIR.value, _METHODS.value,
              command=" ".join(["python -m experiments.compare"] + sys.argv[1:]),
              method_settings=_cli.method_settings(config))


if __name__ == "__main__":
  _cli.run(main)
