"""What `python -m experiments.compare` gives every method: the byte-level LM on pydoc's train
split, AdamW on 8 workers, and how the results are read (config.compare; see the module
docstring of experiments/compare/). `compare.py:long`: a larger LM, longer sequences and
runs, about 5 CPU-minutes per trial.

`steps` is the reference's run that sets the target: the median over seeds of its best
held-out loss in `steps` steps. On each link the budget is `budget` times the reference's
median time to that target, and every trial trains until it reaches the target or spends
the budget on every link, up to `max_steps`. The links are those between the scenario's
sites (compare.scenario; each a bandwidth per site or per device, see `jaxcomm.comm.Link`):
the default asks about a 1B LM on 2 sites x 8 H100s over a WAN, the internet, or one
datacenter's InfiniBand."""

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
      compute_repeats=10,            # --scale=proxy: interleaved rounds timing each local step
      # The clock: "scenario" (each method's step planned at the scenario's size on its
      # sites, experiments/compare/scale.py; the proxy trains with one replica per site), or
      # "proxy" (the proxy's own measured compute and compiled step on each link, per device).
      scale="scenario",
      scenario=ml_collections.ConfigDict(dict(
          model="llama_1b",          # a preset of experiments/configs/models/ or a .py file
          sites=2,                   # S sites (the mesh's replica axis); must divide 8
          per_site=8,                # d devices per site (the inner axis)
          inner="fsdp",              # the inner axis: fsdp (ZeRO-3 inside a site) or data
          inside="nvlink",           # the link inside a site (per device)
          device="h100",             # accelerator preset (jaxcomm.plan.DEVICES)
          mfu=0.4,                   # model FLOPs utilisation, in (0, 1]
          compute_seconds=config_dict.placeholder(float),  # a measured compute time per step
          plan_cache=config_dict.placeholder(str))),  # default: ~/.cache/jaxcomm/plans
      proxies=1,                     # 2: also a proxy 4x the parameters (the transfer check)
      # A second score: time to the target and goodput under a failure model ("none", a
      # preset of jaxcomm.sim.FAILURE_PRESETS or key=value settings), `failure_draws` seeded
      # draws per training seed (experiments/compare/failures.py).
      failures="none",
      failure_draws=5))
  if arg == "long":  # ~0.3 CPU-seconds per step on 8 emulated devices (measured)
    c.steps = 1000
    c.compare.max_steps = 3000
    c.compare.eval_every = 50
    c.model.update(d_model=96, num_layers=3, d_ff=384)
    c.data.seq_len = 128
  elif arg:
    raise ValueError(f"configs/compare.py:{arg}: allowed arguments: long.")
  return c
