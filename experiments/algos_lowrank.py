"""--algo=powersgd|lq_sgd|onebit_adam|demo: the compressors with their own protocols.

  python -m experiments.train --algo=powersgd --rank=2 --model=mlp --optimizer=momentum
  python -m experiments.train --algo=lq_sgd --rank=4 --bits=8 --collective=two_phase
  python -m experiments.train --algo=onebit_adam --freeze_step=100 --lr=1e-3
  python -m experiments.train --algo=demo --chunk=64 --k=32 --beta=0.999 --lr=1e-3

Settings come from `cfg.extra` (train.py flags): rank, memory (none turns PowerSGD's error
feedback off), start_iter, bits, alpha, collective, freeze_step, beta, chunk, k.
1-bit Adam and DeMo are complete optimisers: they replace the inner optimiser (--lr and
--weight_decay are theirs).
"""

from __future__ import annotations

import jax
import optax

from experiments import builders
from jaxcomm import sync


def _lowrank_options(extra: dict) -> dict:
  return dict(memory=None if extra.get("memory", "ef") in ("none", None) else "ef",
              start_iter=extra.get("start_iter", 0))


@builders.algorithm("powersgd")
def _powersgd(cfg: builders.Config, inner: optax.GradientTransformation):
  return optax.chain(sync.powersgd(cfg.extra.get("rank", 2), axis_name=cfg.axis_name,
                                   key=jax.random.key(cfg.seed), **_lowrank_options(cfg.extra)), inner)


@builders.algorithm("lq_sgd")
def _lq_sgd(cfg: builders.Config, inner: optax.GradientTransformation):
  collective = cfg.extra.get("collective", "auto")
  return optax.chain(sync.lq_sgd(
      cfg.extra.get("rank", 2), bits=cfg.extra.get("bits", 8), alpha=cfg.extra.get("alpha", 10.0),
      collective="two_phase" if collective in (None, "auto") else collective,
      axis_name=cfg.axis_name, key=jax.random.key(cfg.seed), **_lowrank_options(cfg.extra)), inner)


@builders.algorithm("onebit_adam")
def _onebit_adam(cfg: builders.Config, inner: optax.GradientTransformation):
  del inner  # a complete optimiser
  return sync.onebit_adam(cfg.lr, freeze_step=cfg.extra.get("freeze_step", 100),
                          axis_name=cfg.axis_name)


@builders.algorithm("demo")
def _demo(cfg: builders.Config, inner: optax.GradientTransformation):
  del inner  # a complete optimiser
  return sync.demo(cfg.lr, beta=cfg.extra.get("beta", 0.999), chunk=cfg.extra.get("chunk") or 64,
                   k=cfg.extra.get("k", 32), weight_decay=cfg.weight_decay,
                   axis_name=cfg.axis_name)
