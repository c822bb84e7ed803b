r"""PowerSGD (arXiv 1905.13727): compression on ResNet-18 shapes, accuracy at rank 1/2/4.

  python -m experiments.reproduce.powersgd --workdir=runs/reproduce_powersgd
  python -m experiments.reproduce.powersgd --config.reproduce.ranks=2 \
      --config.reproduce.table=False    # one rank, no ResNet-18 table

The claims: rank 2 on ResNet-18 / CIFAR-10 reaches SGD's accuracy with two orders of
magnitude less traffic; error feedback is what makes low rank work.

* Compression table (`reproduce.table`): wire bytes per device of one step of exact DP and
  PowerSGD at each rank on ResNet-18's CIFAR-10 parameter shapes (11.2M parameters), read
  from the compiled program and checked against the bytes the transform counts
  (experiments/compression_table.py's `sync_bytes`; nothing is trained).
* Accuracy: the digits MLP trained with momentum SGD for `steps` on 8 workers, exact DP
  against PowerSGD at each rank (`reproduce.ranks`: 1, 2, 4) with and without error
  feedback, same steps and batches; held-out accuracy on the 20 % test split.

The settings are experiments/configs/reproduce/powersgd.py's (`--help` lists them).
"""

from __future__ import annotations

import os

import jax

from .. import compression_table
from .. import toolkit
from . import _reproduce as rep


def compression_rows(ranks, workers: int) -> list:
  """[method, floats/step, DP / method] on ResNet-18's shapes (compiled, not run)."""
  wanted = ["exact DP (f32 all-reduce)"] + [f"PowerSGD rank {r}" for r in ranks]
  makers = dict(compression_table.methods())
  params = compression_table.model_params("resnet18")
  mesh = rep.mesh_of(workers)
  counted = {}
  for name in wanted:
    counted[name], inspected = compression_table.sync_bytes(makers[name](), params, mesh)
    if counted[name] != round(inspected):
      raise AssertionError(f"{name}: counted {counted[name]} bytes, compiled {inspected}.")
  size = sum(x.size for x in jax.tree.leaves(params))
  dp = counted[wanted[0]]
  return [[name, size, counted[name], counted[name] / 4, dp / counted[name]] for name in wanted]


def run(base, workdir: str, workers: int = 8) -> dict:
  """Trains the digits runs at `base.reproduce.ranks` (and compiles the ResNet-18 table);
  writes the results."""
  ranks = toolkit.values_at_least(base, "reproduce.ranks", 1)
  table = base.reproduce.table
  dp = rep.train_run("DP (momentum SGD)", rep.config(base, "dp"), workers)
  runs = [dp]
  for r in ranks:
    for memory in ("ef", None):
      runs.append(rep.train_run(f"PowerSGD rank {r}" + (" + EF" if memory == "ef" else ", no EF"),
                                rep.config(base, "powersgd", rank=r, memory=memory),
                                workers, rank=r, error_feedback=memory == "ef"))
  sections = [(f"Digits MLP {base.model.hidden}, {workers} workers, {base.steps} steps, "
               f"global batch {base.data.batch_size}, momentum SGD lr {base.optimizer.lr}",
               rep.method_table(runs, dp, base.reproduce.smooth, accuracy=True))]
  rows = []
  if table:
    rows = compression_rows(ranks, workers)
    sections.insert(0, (f"ResNet-18 (CIFAR-10 shapes), {workers} workers: one step, compiled",
                        rep.markdown_table(["method", "parameters", "bytes/step/device",
                                            "floats/step/device", "DP / method"], rows)))
  figure = rep.save_figure(os.path.join(workdir, "powersgd.png"), [
      {"title": "held-out accuracy on digits vs rank", "xlabel": "PowerSGD rank",
       "ylabel": "held-out accuracy", "logx": True,
       "lines": [(name, list(ranks), [r["heldout_accuracy"] for r in runs[1:]
                                      if r["error_feedback"] == ef])
                 for name, ef in (("with error feedback", True), ("without", False))]
       + [("exact DP", [min(ranks), max(ranks)], [dp["heldout_accuracy"]] * 2)]},
      {"title": "training loss on digits", "xlabel": "step",
       "ylabel": f"train loss (mean of last {base.reproduce.smooth})", "logy": True,
       "lines": rep.curve_lines(runs, base.reproduce.smooth)},
  ])
  return rep.write_results(workdir, "PowerSGD: compression and accuracy (arXiv 1905.13727)",
                           sections, base, {"runs": runs, "compression": rows,
                                             "figures": [figure]})


if __name__ == "__main__":
  rep.main("powersgd", run, methods=('dp', 'powersgd'))
