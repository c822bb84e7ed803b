r"""DeMo (arXiv 2411.19870) against AdamW data parallelism: loss and bytes per step.

  python -m experiments.reproduce.demo --workdir=runs/reproduce_demo

The claim: DeMo sends up to 85x less data per GPU than AdamW-DDP at comparable loss (300M
and 1B models). The byte-level LM on 8 workers: exact DP with AdamW against DeMo (each worker
keeps its momentum, splits every tensor into tiles of up to 64 x 64 (each dimension in
chunks of its largest divisor <= 64), sends the top k 2-D DCT-II coefficients of every tile
as float32 values and uint16 indices, all-gathered; sign update) at the paper's k = 32 and
at other k. The all-gather's bytes grow with the workers (W - 1 copies), the ring
all-reduce's do not.

The settings are experiments/configs/reproduce/demo.py's (`--help` lists them), each
overridden as in experiments/train.py, e.g. one k at a smaller scale:

  python -m experiments.reproduce.demo --config.reproduce.ks=32 --config.steps=50
"""

from __future__ import annotations

import os

from .. import toolkit
from . import _reproduce as rep

CHUNK = 64


def run(base, workdir: str, workers: int = 8) -> dict:
  """DP and DeMo at each k of `base.reproduce`; writes results.md, results.json, demo.png."""
  ks = toolkit.values_at_least(base, "reproduce.ks", 1)
  toolkit.number_in(base, "reproduce.demo_lr", 0, low_open=True)
  demo_lr = base.reproduce.demo_lr
  dp = rep.train_run("DP (AdamW)", rep.config(base, "dp"), workers)
  runs = [dp] + [rep.train_run(f"DeMo chunk {CHUNK}, k {k}",
                               rep.config(base, "demo", lr=demo_lr,
                                          chunk=CHUNK, k=k), workers, k=k)
                 for k in ks]
  sections = [(f"Byte-level LM, {workers} workers, {base.steps} steps, global batch "
               f"{base.data.batch_size}; AdamW lr {dp['lr']}, DeMo lr {demo_lr} (beta 0.999)",
               rep.method_table(runs, dp, base.reproduce.smooth))]
  figure = rep.save_figure(os.path.join(workdir, "demo.png"), [
      {"title": "training loss", "xlabel": "step",
       "ylabel": f"train loss (mean of last {base.reproduce.smooth})",
       "lines": rep.curve_lines(runs, base.reproduce.smooth)},
      {"title": "held-out loss vs bytes per step", "xlabel": "bytes/step/device (log scale)",
       "ylabel": "held-out loss", "logx": True,
       "lines": [(r["label"], [r["bytes_per_step"]], [r["heldout_loss"]]) for r in runs]},
  ])
  return rep.write_results(workdir, "DeMo against AdamW data parallelism (arXiv 2411.19870)",
                           sections, base, {"runs": runs, "figures": [figure]})


if __name__ == "__main__":
  rep.main("demo", run, methods=('dp', 'demo'))
