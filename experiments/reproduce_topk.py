r"""Top-k sparsification with and without memory (Stich et al., NeurIPS 2018; EF arXiv 1901.09847).

  python -m experiments.reproduce_topk --workdir=runs/reproduce_topk

The claim: SGD that applies only the top-k coordinates of its gradient converges at the rate
of SGD when the coordinates left out are remembered and added to the next gradient (error
feedback / memory); without the memory it stalls or lags. The digits MLP is trained with
plain SGD on 8 workers: exact DP against top-k (each worker's top --fractions of its
gradient, (index, value) pairs all-gathered, `sync.compressed(codecs.top_k(f), memory=...)`)
with memory ("ef") and without, same steps and batches.
"""

from __future__ import annotations

import os

from absl import flags

from experiments import _cli
from experiments import _reproduce as rep


STEPS = 300
LR = 0.5  # plain SGD on the digits MLP


def run(base, workdir: str, fractions=(0.01, 0.1), workers: int = 8) -> dict:
  cfg = lambda algo, **kw: rep.config(base, "mlp", algo, optimizer="sgd", lr=LR, **kw)
  dp = rep.train_run("DP (SGD)", cfg("dp"), workers)
  runs = [dp]
  for f in fractions:
    for memory in ("ef", None):
      runs.append(rep.train_run(
          f"top-{f:g} " + ("with memory" if memory == "ef" else "without memory"),
          cfg("compressed", codec=f"top_k:fraction={f}", memory=memory),
          workers, fraction=f, memory=memory))
  sections = [(f"Digits MLP {base.model.hidden}, {workers} workers, {base.steps} steps, "
               f"global batch {base.data.batch_size}, SGD lr {LR}",
               rep.method_table(runs, dp, base.reproduce.smooth, accuracy=True))]
  figure = rep.save_figure(os.path.join(workdir, "topk.png"), [
      {"title": "training loss on digits", "xlabel": "step",
       "ylabel": f"train loss (mean of last {base.reproduce.smooth})", "logy": True,
       "lines": rep.curve_lines(runs, base.reproduce.smooth)},
      {"title": "training loss vs communication", "xlabel": "cumulative bytes sent per device",
       "ylabel": f"train loss (mean of last {base.reproduce.smooth})", "logx": True, "logy": True,
       "lines": [(r["label"], _cumsum(r["curve"]["wire_bytes"]), y)
                 for r, (_, _, y) in zip(runs, rep.curve_lines(runs, base.reproduce.smooth))]},
  ])
  return rep.write_results(workdir, "Top-k with and without memory (Stich et al. 2018)",
                           sections, base, {"runs": runs, "figures": [figure]})


def _cumsum(values):
  import numpy as np
  return np.cumsum(values)


def main(argv):
  del argv
  rep.start_devices()
  run(rep.base_from_flags(STEPS), rep.workdir_from_flags("reproduce_topk"),
      [float(f) for f in flags.FLAGS.fractions])


if __name__ == "__main__":
  rep.define_flags(fractions=("list", ["0.01", "0.1"], "Fractions of coordinates sent."))
  _cli.run(main)
