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
_LINKS = flags.DEFINE_list("links", None, "Link presets (jaxcomm.comm.PRESETS) to time on: the "
                           "links between the scenario's sites. wan and internet are per site "
                           "(a site's bandwidth, shared by its devices that send at once), "
                           "infiniband, ethernet_* and nvlink per device; default: "
                           "config.compare.links.")
_LINK = flags.DEFINE_multi_string("link", [], "A link of your own, added to the others: "
                                  "name:gbit=G,latency_ms=L[,per=site|device] (G Gbit/s per "
                                  "site unless per=device; repeatable).")
_SCALE = flags.DEFINE_enum("scale", None, ["scenario", "proxy"], "scenario: the clock of each "
                           "method's step planned at the scenario's size on its sites (the "
                           "proxy trains with one replica per site); proxy: the proxy's own "
                           "measured compute and compiled step, each link per device (the "
                           "comparison before scenarios). Default: config.compare.scale.")
_MODEL = flags.DEFINE_string("model", None, "The scenario's model: a preset of "
                             "experiments/configs/models/ (gpt2_124m, llama_1b, ...) or a .py "
                             "file of the same form (default: config.compare.scenario.model).")
_SITES = flags.DEFINE_integer("sites", None, "Sites S (must divide the proxy's 8 devices; "
                              "default: config.compare.scenario.sites).")
_PER_SITE = flags.DEFINE_integer("per_site", None, "Devices per site (default: "
                                 "config.compare.scenario.per_site).")
_INSIDE = flags.DEFINE_string("inside", None, "The link inside a site, per device (a preset "
                              "or name:gbit=G,latency_ms=L,per=device; default: "
                              "config.compare.scenario.inside).")
_DEVICE = flags.DEFINE_string("device", None, "Accelerator preset (jaxcomm.plan.DEVICES; "
                              "default: config.compare.scenario.device).")
_MFU = flags.DEFINE_float("mfu", None, "Model FLOPs utilisation in (0, 1] (default: "
                          "config.compare.scenario.mfu).")
_COMPUTE = flags.DEFINE_float("compute_seconds", None, "A measured compute time per step at "
                              "the scenario's size, instead of FLOPs / (peak x MFU).")
_PROXIES = flags.DEFINE_integer("proxies", None, "2: also train a proxy with 4x the "
                                "parameters and report steps to the target relative to DP "
                                "at both sizes (default: config.compare.proxies).")
_FAILURES = flags.DEFINE_string("failures", None, "A second score under a failure model: none, "
                                "a preset of jaxcomm.sim.FAILURE_PRESETS (llama3, yearly, "
                                "...) or key=value settings (mtbf_h=,restart_s=,...; "
                                "default: config.compare.failures, none).")
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
                                target_loss=_TARGET.value, scale=_SCALE.value,
                                proxies=_PROXIES.value, failures=_FAILURES.value, scenario={
                                    "model": _MODEL.value, "sites": _SITES.value,
                                    "per_site": _PER_SITE.value, "inside": _INSIDE.value,
                                    "device": _DEVICE.value, "mfu": _MFU.value,
                                    "compute_seconds": _COMPUTE.value})
  compare.run(config, _WORKDIR.value, _METHODS.value,
              command=" ".join(["python -m experiments.compare"] + sys.argv[1:]),
              method_settings=_cli.method_settings(config))


if __name__ == "__main__":
  _cli.run(main)
