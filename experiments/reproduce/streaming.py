r"""Streaming DiLoCo (arXiv 2501.18512): peak bytes per sync step and loss against DiLoCo and DP.

  python -m experiments.reproduce.streaming --workdir=runs/reproduce_streaming

The claim: splitting the parameters into P fragments that sync in turn cuts the peak
bandwidth to 1/P of DiLoCo's (the same total), and with the outer gradients in 4 bits and
the sync overlapped with inner steps the quality stays that of data parallelism. The
byte-level LM on 8 workers, `steps` inner steps: exact DP (AdamW), DiLoCo at H =
`reproduce.h`, and Streaming DiLoCo with P = `reproduce.fragments` at the same H, once with
float32 outer gradients and no overlap (isolates the fragmenting) and once as in the paper
(fp4 E2M1 outer gradients, overlap τ = `reproduce.overlap`, merge α = 0.5). Peak = the most
bytes one device sends in a single step.

The settings are experiments/configs/reproduce/streaming.py's (`--help` lists them), e.g.

  python -m experiments.reproduce.streaming --config.reproduce.fragments=2
"""

from __future__ import annotations

import os

from .. import toolkit
from . import _reproduce as rep


def run(base, workdir: str, workers: int = 8) -> dict:
  """DP, DiLoCo and Streaming DiLoCo at `base.reproduce`'s h, fragments and overlap."""
  for path, low in (("h", 1), ("fragments", 1), ("overlap", 0)):
    toolkit.int_at_least(base, f"reproduce.{path}", low)
  h, fragments, overlap = (base.reproduce[k] for k in ("h", "fragments", "overlap"))
  lm = lambda method, **settings: rep.config(base, method, sync_every=h, **settings)
  dp = rep.train_run("DP (AdamW)", rep.config(base, "dp"), workers)
  diloco = rep.train_run(f"DiLoCo H={h}", lm("diloco"), workers)
  exact = rep.train_run(f"Streaming P={fragments}, f32, overlap 0",
                        lm("streaming_diloco", fragments=fragments, overlap=0,
                           codec="none"), workers, fragments=fragments)
  paper = rep.train_run(f"Streaming P={fragments}, fp4, overlap {overlap}",
                        lm("streaming_diloco", fragments=fragments, overlap=overlap),
                        workers, fragments=fragments)
  runs = [dp, diloco, exact, paper]
  sections = [(f"Byte-level LM, {workers} workers, {base.steps} inner steps, global batch "
               f"{base.data.batch_size}, H={h}, P={fragments}",
               rep.method_table(runs, dp, base.reproduce.smooth, peak=True))]
  figure = rep.save_figure(os.path.join(workdir, "streaming.png"), [
      {"title": "training loss", "xlabel": "step",
       "ylabel": f"train loss (mean of last {base.reproduce.smooth})",
       "lines": rep.curve_lines(runs, base.reproduce.smooth)},
      {"title": "bytes sent per step (first 2H steps)", "xlabel": "step",
       "ylabel": "bytes sent by one device in the step",
       "lines": [(r["label"], list(range(1, 2 * h + 1)), r["curve"]["wire_bytes"][:2 * h])
                 for r in runs[1:]]},
  ])
  return rep.write_results(workdir, "Streaming DiLoCo: peak bandwidth and loss "
                           "(arXiv 2501.18512)", sections, base,
                           {"runs": runs, "figures": [figure]})


if __name__ == "__main__":
  rep.main("streaming", run, methods=('dp', 'diloco', 'streaming_diloco'))
