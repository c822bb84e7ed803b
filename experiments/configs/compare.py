"""What `python -m experiments.compare` gives every method: the byte-level LM on pydoc's train
split, AdamW on 8 workers, and how the results are read (config.compare; see the module
docstring of experiments/compare/). `compare.py:long`: a larger LM, longer sequences and
runs, about 5 CPU-minutes per trial.

`steps` is the reference's run that sets the target: the median over seeds of its best
held-out loss in `steps` steps. On each link the budget is `budget` times the reference's
median time to that target, and every trial trains until it reaches the target or spends
the budget on every link, up to `max_steps`."""

import ml_collections
from ml_collections import config_dict

from .. import config


def get_config(arg: str | None = None):
  c = config.base_config("dp")
  c.steps = 150
  c.checkpoint_every = 0
  c.data.split = "train"             # the test split is held out for the target
  c.compare = ml_collections.ConfigDict(dict(
      reference="dp_bf16",           # the label whose trials set the target
      reference_pool=("dp_bf16", "dp"),  # per link the reference: the fastest of these
      ruleset="default",             # default: each method's settings; tuned: tuning() lists
      seeds=3,                       # seeds (studies) per method and setting
      population=True,               # a method's seeds in one program (Trainer(trials=S))
      budget=2.0,                    # each link's budget: the reference's median time x this
      max_steps=600,                 # no trial trains more inner steps than this
      links=("wan", "internet", "infiniband"),  # presets (comm.PRESETS) or name:gbit=,latency_ms=
      eval_every=10,                 # held-out evaluations (untimed) at fixed intervals of
                                     # simulated time: the reference's time for this many
                                     # steps on each link
      eval_batch=128,                # test-split sequences in the held-out evaluation
      smooth=10,                     # records in the trailing mean of the training curve
      schedule="constant",           # constant | schedule_free | wsd (the inner optimiser's)
      warmup_steps=0,                # schedule_free, wsd: its linear warmup (0: none)
      decay_fraction=0.2,            # wsd: the last fraction of each link's budget decays
      target_loss=config_dict.placeholder(float),  # default: from the reference's trials
      compute_repeats=10))           # interleaved rounds timing each local step
  if arg == "long":  # ~0.3 CPU-seconds per step on 8 emulated devices (measured)
    c.steps = 1000
    c.compare.max_steps = 3000
    c.compare.eval_every = 50
    c.model.update(d_model=96, num_layers=3, d_ff=384)
    c.data.seq_len = 128
  elif arg:
    raise ValueError(f"configs/compare.py:{arg}: allowed arguments: long.")
  return c
