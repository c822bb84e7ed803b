r"""An NNX MLP with Dropout and BatchNorm trained by `fit` on a grain pipeline, killable.

  python tests/nnx_runner.py --workdir=DIR --steps=12 [--kill_at=7]

The resume test runs it, kills it with SIGKILL before step --kill_at (once a checkpoint of
an earlier step is on disk), runs it again to the end, and compares the final state bit for
bit with the same training done in its own process (`task()` builds both). Every batch the
program takes is recorded in DIR/batches.jsonl as (step, sha256 of its bytes), so the test
sees where the resumed run picked up the data stream.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH, EVERY = 32, 4


def task():
  """(trainer, model, batches): the run both this program and the test build."""
  import optax
  from flax import nnx
  from jaxcomm import data, models, sync, train
  model = models.NnxMLP(64, hidden=(16,), num_classes=10, dropout=0.3, batch_norm=True,
                        rngs=nnx.Rngs(params=0, dropout=1))
  trainer = train.Trainer(models.nnx_classifier_loss,
                          optax.chain(sync.mean("data"), optax.adam(1e-2, eps=1e-4)),
                          train.make_mesh({"data": 8}), has_aux=True)
  return trainer, model, data.batches("digits", BATCH, seed=0)


def fingerprint(batch: dict) -> str:
  return hashlib.sha256(b"".join(batch[k].tobytes() for k in sorted(batch))).hexdigest()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--kill_at", type=int, default=-1)
  args = parser.parse_args()
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  from jaxcomm import train
  trainer, model, batches = task()
  checkpoints = os.path.join(args.workdir, "checkpoints")
  record = open(os.path.join(args.workdir, "batches.jsonl"), "a", encoding="utf-8")

  def batch_fn(step):
    if step == args.kill_at:
      while not any(n.isdigit() for n in os.listdir(checkpoints)):
        time.sleep(0.05)
      os.kill(os.getpid(), signal.SIGKILL)
    batch = batches[step]
    record.write(json.dumps({"step": step, "sha": fingerprint(batch)}) + "\n")
    record.flush()
    return batch

  train.fit(trainer, trainer.init(model), batch_fn, args.steps, workdir=args.workdir,
            log_every=1, progress=False,
            checkpointer=train.Checkpointer(checkpoints, every=EVERY, keep=2))


if __name__ == "__main__":
  main()
