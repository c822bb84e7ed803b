r"""A population of seeds in one program against the same seeds one after the other.

  python -m benchmarks.population --methods=dp_bf16,diloco_h10 --seeds=3 --steps=40

For each method of experiments/compare.py's `METHODS`, trains `--seeds` seeds of `make run`'s
configuration (experiments/configs/compare.py) for `--steps` steps twice through
`compare_trials.train_population`: as one program (`Trainer(trials=S)`) and one after the other
(one run per seed), each with its compile, its held-out evaluations and its reads, as
`make run` does. Prints the wall seconds of both and the speed-up. Without a persistent
compilation cache, so that each side pays its own compiles.
"""

from __future__ import annotations

import time

import jax
from absl import app, flags

from experiments import _compare_settings as compare_settings
from experiments import _compare_trials as compare_trials
from experiments import compare
from experiments.configs import compare as compare_config

_METHODS = flags.DEFINE_list("methods", ["dp_bf16", "diloco_h10"], "compare.METHODS labels.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds in the population.")
_STEPS = flags.DEFINE_integer("steps", 40, "Steps each seed trains.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices.")


def main(argv):
  del argv
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  config = compare_config.get_config()
  links = compare_settings.links(config)
  heldout = compare_trials.heldout_fn(config)
  print(f"{'method':<16}{'one program':>14}{'one after the other':>22}{'speed-up':>10}")
  for label in _METHODS.value:
    base = compare_settings.method_config(config, compare.METHODS[label])
    seeds = [compare_settings.seeded(base, s) for s in range(_SEEDS.value)]
    seconds = {}
    for together in (True, False):
      start = time.perf_counter()
      pop = compare_trials.train_population(label, 0, seeds, links, heldout, _STEPS.value, together)
      seconds[together] = time.perf_counter() - start
      assert pop.together == together
    print(f"{label:<16}{seconds[True]:>12.1f} s{seconds[False]:>20.1f} s"
          f"{seconds[False] / seconds[True]:>9.2f}x", flush=True)


if __name__ == "__main__":
  app.run(main)
