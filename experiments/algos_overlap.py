"""Overlap and staleness methods for `--algo`: delayed, acco, stale.

Flags (experiments/train.py) arrive in `cfg.extra`: `delay`, `compensation`, `dc_lambda`
(stale) and `micro_batches` (acco: "N" for every worker, or "n_0,...,n_{W-1}").
"""

from __future__ import annotations

from typing import Callable

import optax

from experiments import builders
from jaxcomm import local


def micro_batches(cfg: builders.Config) -> int | tuple[int, ...]:
  """`cfg.extra["micro_batches"]` as an int or one int per worker (validated by acco)."""
  spec = cfg.extra.get("micro_batches", 1)
  if isinstance(spec, str):
    try:
      counts = tuple(int(s) for s in spec.split(",") if s.strip())
    except ValueError as e:
      raise ValueError(f"micro_batches must be an int or comma-separated ints, got "
                       f"{spec!r}.") from e
    return counts[0] if len(counts) == 1 else counts
  return spec


@builders.algorithm("delayed")
def _delayed(cfg: builders.Config, inner: optax.GradientTransformation):
  return local.delayed(inner, cfg.axis_name)


@builders.algorithm("stale")
def _stale(cfg: builders.Config, inner: optax.GradientTransformation):
  compensation = cfg.extra.get("compensation")
  return local.stale(inner, cfg.extra.get("delay", 1), cfg.axis_name,
                     compensation=None if compensation in (None, "none") else compensation,
                     dc_lambda=cfg.extra.get("dc_lambda", 0.04))


@builders.algorithm("acco")
def _acco(cfg: builders.Config, inner: optax.GradientTransformation):
  return local.acco(inner, cfg.axis_name, micro_batches=micro_batches(cfg))


def _acco_loss(cfg: builders.Config, loss_fn: Callable) -> Callable:
  # Each worker's loss is its mean over the micro-batches it reaches in a round.
  return local.micro_batch_loss(loss_fn, micro_batches(cfg), cfg.axis_name)


_acco.wrap_loss = _acco_loss  # experiments/train.py applies a builder's `wrap_loss` if it has one
