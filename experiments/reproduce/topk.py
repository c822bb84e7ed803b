r"""Top-k sparsification with and without memory (Stich et al., NeurIPS 2018; EF arXiv 1901.09847).

  python -m experiments.reproduce.topk --workdir=runs/reproduce_topk

The claim: SGD that applies only the top-k coordinates of its gradient converges at the rate
of SGD when the coordinates left out are remembered and added to the next gradient (error
feedback / memory); without the memory it stalls or lags. The digits MLP is trained with
plain SGD on 8 workers: exact DP against top-k (each worker's top `reproduce.fractions` of
its gradient, (index, value) pairs all-gathered, `sync.compressed(codecs.top_k(f),
memory=...)`) with memory ("ef") and without, same steps and batches.

The settings are experiments/configs/reproduce/topk.py's (`--help` lists them), e.g.

  python -m experiments.reproduce.topk --config.reproduce.fractions=0.01 --config.steps=100
"""

from __future__ import annotations

import numbers
import os

import numpy as np

from .. import toolkit
from . import _reproduce as rep


def run(base, workdir: str, workers: int = 8) -> dict:
  """DP and top-k at each of `base.reproduce.fractions`, with and without memory."""
  fractions = toolkit.values_at_least(base, "reproduce.fractions", 0, numbers.Real)
  dp = rep.train_run("DP (SGD)", rep.config(base, "dp"), workers)
  runs = [dp]
  for f in fractions:
    for memory in ("ef", None):
      runs.append(rep.train_run(
          f"top-{f:g} " + ("with memory" if memory == "ef" else "without memory"),
          rep.config(base, "compressed", codec=f"top_k:fraction={f}", memory=memory),
          workers, fraction=f, memory=memory))
  sections = [(f"Digits MLP {base.model.hidden}, {workers} workers, {base.steps} steps, "
               f"global batch {base.data.batch_size}, SGD lr {base.optimizer.lr}",
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
  return np.cumsum(values)


if __name__ == "__main__":
  rep.main("topk", run, methods=('dp', 'compressed'))
