"""Turns an experiment's settings into models, losses, datasets and an optax chain.

Library code never sees flags: `experiments/train.py` collects them into a `Config` and
everything below builds from that. A method registers itself with `@algorithm("name")`; its
builder receives the config and the inner optimiser and returns the full transform.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxcomm import data, models, sync


@dataclasses.dataclass
class Config:
  """Every setting an experiment can change (flags map onto these fields one to one)."""
  model: str = "lm"
  dataset: str = "pydoc"
  algo: str = "dp"
  optimizer: str = "adamw"
  lr: float = 3e-3
  weight_decay: float = 0.0
  steps: int = 200
  batch_size: int = 32
  seq_len: int = 64
  seed: int = 0
  axis_name: Any = "data"
  reduce_dtype: str | None = None
  # Model sizes.
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  d_ff: int = 256
  hidden: tuple = (64,)
  extra: dict = dataclasses.field(default_factory=dict)  # method-specific settings


ALGORITHMS: dict[str, Callable] = {}
OPTIMIZERS = ("adamw", "adam", "sgd", "momentum")
MODELS = ("lm", "mlp")


def algorithm(name: str):
  """Registers `fn(cfg, inner) -> optax.GradientTransformation` under `name`."""

  def register(fn):
    ALGORITHMS[name] = fn
    return fn

  return register


def inner_optimizer(cfg: Config) -> optax.GradientTransformation:
  if cfg.optimizer == "adamw":
    return optax.adamw(cfg.lr, weight_decay=cfg.weight_decay)
  if cfg.optimizer == "adam":
    return optax.adam(cfg.lr)
  if cfg.optimizer == "sgd":
    return optax.sgd(cfg.lr)
  if cfg.optimizer == "momentum":
    return optax.sgd(cfg.lr, momentum=0.9)
  raise ValueError(f"optimizer {cfg.optimizer!r} is unknown; allowed: {', '.join(OPTIMIZERS)}.")


@algorithm("dp")
def _dp(cfg: Config, inner: optax.GradientTransformation):
  dtype = jnp.dtype(cfg.reduce_dtype) if cfg.reduce_dtype else None
  return optax.chain(sync.mean(cfg.axis_name, dtype=dtype), inner)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  if cfg.algo not in ALGORITHMS:
    raise ValueError(f"algo {cfg.algo!r} is unknown; allowed: {', '.join(sorted(ALGORITHMS))}.")
  return ALGORITHMS[cfg.algo](cfg, inner_optimizer(cfg))


def task_loss(cfg: Config, loss_fn: Callable) -> Callable:
  """The loss the Trainer differentiates for `cfg.algo`: the builder's `wrap_loss` applied
  (e.g. ACCO's mean over a worker's micro-batches), or `loss_fn` itself."""
  wrap_loss = getattr(ALGORITHMS[cfg.algo], "wrap_loss", None)
  return loss_fn if wrap_loss is None else wrap_loss(cfg, loss_fn)


def make_task(cfg: Config):
  """(model, loss_fn, init params, batch_fn(step) -> global numpy batch, has_aux, eval_fn)."""
  if cfg.model not in MODELS:
    raise ValueError(f"model {cfg.model!r} is unknown; allowed: {', '.join(MODELS)}.")
  dataset = data.load(cfg.dataset)
  key = jax.random.key(cfg.seed)
  pi, pc = jax.process_index(), jax.process_count()
  if cfg.model == "lm":
    if not isinstance(dataset, data.TextDataset):
      raise ValueError(f"model 'lm' needs a text dataset (pydoc, stdlib, text:<path>), "
                       f"got dataset {cfg.dataset!r}.")
    model = models.TransformerLM(d_model=cfg.d_model, num_layers=cfg.num_layers,
                                 num_heads=cfg.num_heads, d_ff=cfg.d_ff, max_len=cfg.seq_len,
                                 layout=cfg.extra.get("layout"))
    params = model.init(key, jnp.zeros((1, cfg.seq_len), jnp.int32))
    batch_fn = lambda t: dataset.batch(t, cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                                       process_index=pi, process_count=pc)
    return model, models.lm_loss(model), params, batch_fn, False
  if not isinstance(dataset, data.ArrayDataset):
    raise ValueError(f"model 'mlp' needs an array dataset (digits), got {cfg.dataset!r}.")
  model = models.MLP(hidden=tuple(cfg.hidden), num_classes=dataset.num_classes)
  params = model.init(key, jnp.zeros((1, dataset.x.shape[1])))
  batch_fn = lambda t: dataset.batch(t, cfg.batch_size, seed=cfg.seed, process_index=pi,
                                     process_count=pc)
  return model, models.classifier_loss(model), params, batch_fn, True


# Method modules register their algorithms on import (one line each).
from experiments import algos_compression  # noqa: E402,F401  pylint: disable=all
from experiments import algos_gossip  # noqa: E402,F401  pylint: disable=all
from experiments import algos_local  # noqa: E402,F401  pylint: disable=all
from experiments import algos_lowrank  # noqa: E402,F401  pylint: disable=all
from experiments import algos_overlap  # noqa: E402,F401  pylint: disable=all
from experiments import algos_parallel  # noqa: E402,F401  pylint: disable=all
