"""What `python -m experiments.compare` gives every method: the byte-level LM on pydoc, AdamW
on 8 workers, and how the results are read (config.compare). `compare.py:long`: a larger LM,
longer sequences and runs, about 5 CPU-minutes per method.

`steps` is the reference method's (exact DP's) run: on each link the time budget is that
run's simulated time (times `budget`), and every method trains the inner steps that fit in
it on that link, up to `max_steps`."""

import ml_collections
from ml_collections import config_dict

from experiments import config


def get_config(arg: str | None = None):
  c = config.base_config("dp")
  c.steps = 150
  c.checkpoint_every = 0
  c.compare = ml_collections.ConfigDict(dict(
      reference="dp",                # the label whose run sets the budget and the target
      budget=1.0,                    # each link's budget: the reference's time x this
      max_steps=600,                 # no method trains more inner steps than this
      links=("wan", "internet", "infiniband"),  # presets (comm.PRESETS) or name:gbit=,latency_ms=
      smooth=10,                     # records in the trailing mean of the loss curve
      target_loss=config_dict.placeholder(float),  # default: from the reference's run
      target_fraction=0.8,           # default target: its smoothed loss at this fraction
      compute_repeats=10))           # timings of each method's local step (fastest kept)
  if arg == "long":  # ~0.3 CPU-seconds per step on 8 emulated devices (measured)
    c.steps = 1000
    c.compare.max_steps = 3000
    c.model.update(d_model=96, num_layers=3, d_ff=384)
    c.data.seq_len = 128
  elif arg:
    raise ValueError(f"configs/compare.py:{arg}: allowed arguments: long.")
  return c
