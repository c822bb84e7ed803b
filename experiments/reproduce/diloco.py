r"""DiLoCo (arXiv 2311.08105): loss against the sync period H and the number of workers.

  python -m experiments.reproduce.diloco --workdir=runs/reproduce_diloco

The claims: with 8 workers DiLoCo matches fully synchronous training while communicating H
times less, and the loss degrades only slowly as H grows; more replicas help with
diminishing returns. Two sweeps on the byte-level LM (pydoc, held-out split for the eval):

* H in `reproduce.hs` at 8 workers, against exact data parallelism (AdamW on the
  all-reduced gradient) at the same steps and batches;
* workers in `reproduce.workers` at H = `reproduce.h_fixed`, each worker taking
  `reproduce.per_worker_batch` sequences per step (the global batch grows with the workers,
  as in the paper), against DP with the same global batch.

Inner AdamW (lr 3e-3), outer Nesterov SGD (lr 0.7, momentum 0.9) as in the paper. Each row
gives the wire bytes per step counted by the transform: an all-reduce of |θ| every H steps.

The paper's protocol (`reproduce.warm_start_steps` = N): every run, DP's and DiLoCo's alike,
starts from the same parameters, pretrained by exact DP for N steps at `data.batch_size` on
8 workers, and then trains `steps` more on the batches that follow (the same tokens for
every run of a sweep); each run starts a fresh inner optimiser. The H table then opens with
that starting point's losses.

  python -m experiments.reproduce.diloco --config.reproduce.warm_start_steps=150 \
      --workdir=runs/diloco_warm

The settings are experiments/configs/reproduce/diloco.py's (`--help` lists them), each
overridden as in experiments/train.py (`--config.<path>=<value>`, a tuple as 1,2,4).
"""

from __future__ import annotations

import os

from .. import toolkit
from . import _reproduce as rep


def _diloco(base, h: int, workers: int, batch: int, **info) -> dict:
  return rep.train_run(f"DiLoCo H={h}", rep.config(base, "diloco", batch_size=batch, sync_every=h),
                       workers, H=h, **info)


def _dp(base, workers: int, batch: int, **info) -> dict:
  return rep.train_run("DP (AdamW)", rep.config(base, "dp", batch_size=batch),
                       workers, H=1, **info)


def run(base, workdir: str) -> dict:
  """Both sweeps of `base.reproduce`; writes results.md, results.json and diloco.png into
  workdir."""
  hs = toolkit.values_at_least(base, "reproduce.hs", 1)
  workers = toolkit.values_at_least(base, "reproduce.workers", 1)
  for path in ("reproduce.h_fixed", "reproduce.per_worker_batch"):
    toolkit.int_at_least(base, path, 1)
  h_fixed, per_worker_batch = base.reproduce.h_fixed, base.reproduce.per_worker_batch
  dp8 = _dp(base, 8, base.data.batch_size)
  by_h = [_diloco(base, h, 8, base.data.batch_size) for h in hs]
  # At 8 workers with per_worker_batch * 8 == batch_size these are the H sweep's runs
  # (train_run does not repeat them).
  by_w = [(_diloco(base, h_fixed, w, per_worker_batch * w), _dp(base, w, per_worker_batch * w))
          for w in workers]

  start, _, warm = rep.warm_start(rep.config(base, "dp"))
  h_rows = [[start["label"], "-", start["final_train_loss"], start["heldout_loss"], "-", "-"]
            ] if start else []
  h_rows += [["DP (AdamW)", "every step", dp8["final_train_loss"], dp8["heldout_loss"],
              dp8["bytes_per_step"], 1.0]]
  h_rows += [[r["label"], r["H"], r["final_train_loss"], r["heldout_loss"], r["bytes_per_step"],
              dp8["bytes_per_step"] / r["bytes_per_step"]] for r in by_h]
  w_rows = [[r["workers"], r["label"], r["batch_size"], r["final_train_loss"], r["heldout_loss"],
             r["bytes_per_step"]] for pair in by_w for r in pair]
  train_loss = f"train loss (mean of last {base.reproduce.smooth})"
  steps = f"{base.steps} steps" + (f" after a DP warm start of {warm}" if warm else "")
  sections = [
      (f"Loss vs H at 8 workers ({steps}, global batch {base.data.batch_size})",
       rep.markdown_table(["method", "H", train_loss, "held-out loss", "bytes/step/device",
                           "DP bytes / bytes"], h_rows)),
      (f"Loss vs workers at H={h_fixed} ({per_worker_batch} sequences per worker per step, "
       f"{steps})",
       rep.markdown_table(["workers", "method", "global batch", train_loss, "held-out loss",
                           "bytes/step/device"], w_rows)),
  ]
  figure = rep.save_figure(os.path.join(workdir, "diloco.png"), [
      {"title": "held-out loss vs sync period (8 workers)", "xlabel": "H (inner steps per sync)",
       "ylabel": "held-out loss", "logx": True,
       "lines": [("DiLoCo", [r["H"] for r in by_h], [r["heldout_loss"] for r in by_h]),
                 ("exact DP", [min(hs), max(hs)], [dp8["heldout_loss"]] * 2)]},
      {"title": f"held-out loss vs workers (H={h_fixed})", "xlabel": "workers", "logx": True,
       "ylabel": "held-out loss",
       "lines": [("DiLoCo", [d["workers"] for d, _ in by_w], [d["heldout_loss"] for d, _ in by_w]),
                 ("exact DP", [p["workers"] for _, p in by_w],
                  [p["heldout_loss"] for _, p in by_w])]},
      {"title": "training loss (8 workers)", "xlabel": "step", "ylabel": train_loss,
       "lines": rep.curve_lines([dp8] + by_h, base.reproduce.smooth)},
  ])
  return rep.write_results(workdir, "DiLoCo: loss vs H and vs workers (arXiv 2311.08105)",
                           sections, base, {"by_h": [dp8] + by_h,
                                             "by_workers": [r for pair in by_w for r in pair],
                                             "figures": [figure]})


if __name__ == "__main__":
  rep.main("diloco", run, methods=('dp', 'diloco'))
