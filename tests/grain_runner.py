r"""One process of a multi-process run that reads grain batches and assembles global arrays.

  python -m experiments.launch_local --processes=2 --devices=8 \
      --program=tests/grain_runner.py -- --workdir=DIR

Each process joins `jax.distributed`, builds `data.batches` (its own share, by JAX's process
index), turns its share into the global batch with `Trainer.shard_batch`, gathers that
back to the host, and saves DIR/process<i>.npz: its shares, the gathered global batches,
and which records it read (the keys its source was asked for).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS, BATCH, SEQ, SEED = 3, 16, 16, 3


class Recording:
  """A grain source that notes every record key it is asked for."""

  def __init__(self, source):
    self.source, self.read = source, []

  def __len__(self):
    return len(self.source)

  def __getitem__(self, key):
    self.read.append(key)
    return self.source[key]


def main():
  parser = argparse.ArgumentParser()
  for name in ("workdir", "coordinator"):
    parser.add_argument(f"--{name}")
  for name in ("num_processes", "process_id", "devices", "heartbeat_timeout"):
    parser.add_argument(f"--{name}", type=int)
  args = parser.parse_args()
  import jax
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  jax.config.update("jax_num_cpu_devices", args.devices)
  from jaxcomm import data, train
  train.start_distributed(args.coordinator, args.num_processes, args.process_id,
                          heartbeat_timeout_s=args.heartbeat_timeout)
  source = Recording(data.source("pydoc", SEQ))
  ds = data.batches(source, BATCH, seed=SEED)
  trainer = train.Trainer(lambda p, b: 0.0, optax.sgd(0.1), train.make_mesh({"data": 8}))
  shares, full = [], []
  for t in range(STEPS):
    shares.append(ds[t]["tokens"])
    global_batch = trainer.shard_batch({"tokens": shares[-1]})["tokens"]
    full.append(multihost_utils.process_allgather(global_batch, tiled=True))
  np.savez(os.path.join(args.workdir, f"process{jax.process_index()}.npz"),
           shares=np.stack(shares), full=np.stack(full), read=np.array(source.read))


if __name__ == "__main__":
  main()
