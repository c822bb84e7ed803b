r"""A population of seeds in one program against the same seeds one after the other.

  python -m benchmarks.population --config.methods=dp_bf16,diloco_h10 --config.seeds=3 \
      --config.steps=40

For each method of experiments.compare's `METHODS`, trains `seeds` seeds of `make run`'s
configuration (experiments/configs/compare.py) for `steps` steps twice through
`compare.trials.train_population`: as one program (`Trainer(trials=S)`) and one after the other
(one run per seed), each with its compile, its held-out evaluations and its reads, as
`make run` does. Prints the wall seconds of both and the speed-up. Without a persistent
compilation cache, so that each side pays its own compiles.
"""

from __future__ import annotations

import time

import jax
import ml_collections
from absl import flags

from experiments import _cli, compare
from experiments.compare import settings as compare_settings
from experiments.compare import trials as compare_trials
from experiments import toolkit
from experiments.configs import compare as compare_config


def get_config() -> ml_collections.ConfigDict:
  """The benchmark's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      methods="dp_bf16,diloco_h10",   # compare.METHODS labels, comma-separated
      seeds=3,                        # seeds in the population
      steps=40))                      # steps each seed trains


def main(argv):
  del argv
  c = flags.FLAGS.config
  labels = toolkit.names_in(c, "methods", list(compare.METHODS))
  for name in ("seeds", "steps"):
    toolkit.int_at_least(c, name, 1)
  jax.config.update("jax_num_cpu_devices", flags.FLAGS.devices)
  config = compare_config.get_config()
  links = compare_settings.links(config)
  heldout = compare_trials.heldout_fn(config)
  print(f"{'method':<16}{'one program':>14}{'one after the other':>22}{'speed-up':>10}")
  for label in labels:
    base = compare_settings.method_config(config, compare.METHODS[label])
    seeds = [compare_settings.seeded(base, s) for s in range(c.seeds)]
    seconds = {}
    for together in (True, False):
      start = time.perf_counter()
      pop = compare_trials.train_population(label, 0, seeds, links, heldout, c.steps,
                                            together)
      seconds[together] = time.perf_counter() - start
      assert pop.together == together
    print(f"{label:<16}{seconds[True]:>12.1f} s{seconds[False]:>20.1f} s"
          f"{seconds[False] / seconds[True]:>9.2f}x", flush=True)


if __name__ == "__main__":
  _cli.run(main, get_config(), devices=8)
