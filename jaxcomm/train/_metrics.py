"""What `fit` shows and writes: a tqdm progress bar, `metrics.jsonl` and TensorBoard events.

TensorBoard event files are written with tensorboardX: pure Python (protobuf and numpy), no
TensorFlow. `clu.metric_writers.SummaryWriter` writes through `tf.summary` and so needs
TensorFlow installed, a heavy dependency for a JAX toolkit whose users run on CPU
emulation as often as on accelerators; tensorboardX writes the same event format, which
TensorBoard's own reader (`event_accumulator`) reads back. Only process 0 writes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import tqdm
from tensorboardX import SummaryWriter

from jaxcomm import comm

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
  """Appends rows to `workdir/metrics.jsonl` and their numbers to TensorBoard scalars.

  Args:
    workdir: the run's directory (created if needed).
    first_step: the step the run starts from; on a resumed run TensorBoard drops the
      events the interrupted run wrote after it (they are logged again).
  """

  def __init__(self, workdir: str, first_step: int = 0):
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, METRICS_FILE), "a", encoding="utf-8")
    self._tb = SummaryWriter(logdir=workdir, purge_step=first_step + 1 if first_step else None)

  def write(self, row: dict) -> None:
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()
    for name, value in row.items():
      if name != "step" and isinstance(value, (int, float)):
        self._tb.add_scalar(name, value, row["step"])
    self._tb.flush()

  def text(self, tag: str, text: str, step: int) -> None:
    self._tb.add_text(tag, text, step)

  def close(self) -> None:
    self._jsonl.close()
    self._tb.close()


def _in_notebook() -> bool:
  """Whether this process is a Jupyter kernel (importing ipykernel alone is not enough:
  nbclient does so to run notebooks)."""
  ipython = sys.modules.get("IPython")
  shell = ipython.get_ipython() if ipython is not None else None
  return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm.tqdm:
  """A tqdm bar on stderr (rate and ETA), off unless enabled, on process 0, and on a
  terminal or in a notebook (a log file gets no bar)."""
  on = enabled and jax.process_index() == 0 and (sys.stderr.isatty() or _in_notebook())
  return tqdm.tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                   file=sys.stderr, disable=not on)


def bytes_table(report: comm.CollectiveReport) -> str:
  """Markdown table of a compiled step's wire bytes per mesh axis (TensorBoard's text tab)."""
  rows = ["| mesh axes | collectives | wire bytes per call (per device) |", "|---|---:|---:|"]
  counts: dict = {}
  for c in report:
    counts[c.axes] = counts.get(c.axes, 0) + 1
  for axes, nbytes in sorted(report.by_axis().items()):
    rows.append(f"| {','.join(axes) or '?'} | {counts[axes]} | {nbytes:,.0f} |")
  rows.append(f"| total | {len(report)} | {report.wire_bytes():,.0f} |")
  note = ("Read from the compiled step (`comm.inspect`); collectives inside conditional "
          "branches (a sync every H steps) are counted as if taken.")
  return "\n".join(rows) + "\n\n" + note


@jax.jit
def consensus_distance(stacked: list) -> jax.Array:
  """sqrt(mean_w ||x_w - mean x||^2) of per-worker leaves [W, ...], where they live.

  `sync.stacked_consensus_distance` computes the same on the host in float64; this one
  reads back a scalar instead of every worker's copy of the parameters.
  """
  sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32) - jnp.mean(x.astype(jnp.float32), 0)))
           for x in stacked)
  return jnp.sqrt(sq / stacked[0].shape[0])


def per_worker_leaves(tree: Any, per_worker: Any) -> list:
  """The leaves of `tree` that carry a leading worker axis."""
  return [x for pw, x in zip(jax.tree.leaves(per_worker), jax.tree.leaves(tree)) if pw]
