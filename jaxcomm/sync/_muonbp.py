"""MuonBP: Muon whose Newton-Schulz runs on each device's block on P - 1 of every P steps."""

from __future__ import annotations

import inspect

import optax

from jaxcomm import _validate as v
from jaxcomm.sync import _muon


def muonbp(learning_rate: optax.ScalarOrSchedule, period: int = 5,
           block_learning_rate: optax.ScalarOrSchedule | None = None,
           **muon_kwargs) -> optax.GradientTransformationExtraArgs:
  """MuonBP (block-periodic Muon) on parameters sharded inside a replica.

  Update t (1-based) is `sync.muon`'s when P = `period` divides t: the whole matrix is
  orthogonalised (owner-based or Gram, `strategy`), scaled by the whole matrix's shape and by
  `learning_rate`. On the other P - 1 updates each device orthogonalises its own block of
  the momentum as a matrix of its own, scales it by the block's shape (optax's
  sqrt(max(1, fan_out / fan_in)) of the block, or `consistent_rms`) and by
  `block_learning_rate`: no communication inside the replica. The momentum, the AdamW
  leaves and the replicas' mean gradient are `sync.muon`'s every step. P = 1 is `sync.muon`.

  Bytes per device: the full updates' inner-axis traffic of `sync.muon` on 1 of every P
  updates (counted in the branch that sends), none on the others; the replica axis carries
  the mean gradient every update.

  The two learning rates are the paper's (its analysis prescribes a step size for the block
  steps and one for the full steps); by default both are `learning_rate`, on top of the shape
  scales of the block and of the whole matrix. `period=5` is our default, not a value read
  from the paper.

  Args:
    learning_rate: the full steps' learning rate (a number or schedule).
    period: P >= 1: one full orthogonalisation every P updates.
    block_learning_rate: the block steps' learning rate (None: `learning_rate`).
    **muon_kwargs: every other argument of `sync.muon` (strategy, axis_name, param_specs,
      beta, nesterov, weight_decay, ns_coeffs, the AdamW settings, ...).

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  References:
    Khaled, Ozkara, Yu, Hong, Park, MuonBP: Faster Muon via Block-Periodic
    Orthogonalization, arXiv 2510.16981.

  >>> import jax.numpy as jnp
  >>> from jaxcomm import sync
  >>> params = {"w": jnp.eye(2), "b": jnp.zeros(2)}
  >>> grads = {"w": jnp.diag(jnp.array([2.0, 1.0])), "b": jnp.ones(2)}
  >>> tx, ref = muonbp(0.1, period=1), sync.muon(0.1)
  >>> u, _ = tx.update(grads, tx.init(params), params)
  >>> want, _ = ref.update(grads, ref.init(params), params)
  >>> bool(jnp.all(u["w"] == want["w"]))
  True
  """
  period = v.integer("period", period, low=1)
  if block_learning_rate is not None and not callable(block_learning_rate):
    v.number("block_learning_rate", block_learning_rate, low=0.0, low_open=True)
  try:
    args = inspect.signature(_muon.muon).bind(learning_rate, **muon_kwargs)
  except TypeError as e:
    raise ValueError(f"muonbp takes sync.muon's arguments; {e}.") from None
  args.apply_defaults()
  return _muon.chain(**args.arguments, period=period, block_learning_rate=block_learning_rate)
