"""What `python -m experiments.compare` gives every method: the byte-level LM on pydoc, 150
AdamW steps on 8 workers (`compare.py:long`: a larger LM, longer sequences, 1000 steps, about
5 CPU-minutes per method), and how the results are read (config.compare)."""

import ml_collections
from ml_collections import config_dict

from experiments import config


def get_config(arg: str | None = None):
  c = config.base_config("dp")
  c.steps = 150
  c.checkpoint_every = 0
  c.compare = ml_collections.ConfigDict(dict(
      smooth=10,                     # records in the trailing mean of the loss curve
      target_loss=config_dict.placeholder(float),  # default: from the DP run
      target_fraction=0.8,           # default target: DP's smoothed loss at this fraction
      networks=("wan", "infiniband"),  # link presets (comm.PRESETS) to simulate
      compute_repeats=10))           # timings of each method's local step (fastest kept)
  if arg == "long":  # ~0.3 CPU-seconds per step on 8 emulated devices (measured)
    c.steps = 1000
    c.model.update(d_model=96, num_layers=3, d_ff=384)
    c.data.seq_len = 128
  elif arg:
    raise ValueError(f"configs/compare.py:{arg}: allowed arguments: long.")
  return c
