"""LQ-SGD: PowerSGD whose P and Q travel log-quantised."""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm
from jaxcomm.sync import _memory
from jaxcomm.sync import _powersgd

LQ_COLLECTIVES = ("gather", "two_phase")


def lq_sgd_bytes(params: Any, rank: int, w: int, bits: int = 8, alpha: float = 10.0,
                 block: int | None = 256, collective: str = "two_phase",
                 min_compression_rate: float = 2, batch_same_shape: bool = True) -> float:
  """Wire bytes per device of one LQ-SGD step: the log codes of all P's and of all Q's by
  `collective`, and an f32 all-reduce of the tensors reduced exactly.

  Example:
    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> lq_sgd_bytes(params, rank=2, w=8), lq_sgd_bytes(params, rank=2, w=1)
    (560.0, 0.0)
  """
  if w <= 1:
    return 0.0
  leaves = jax.tree.leaves(params)
  plan = _powersgd._plan(leaves, rank, min_compression_rate, batch_same_shape)
  p, q = _powersgd._factor_sizes(plan)
  codec = codecs.log_quant(bits, alpha, block=block)
  exact = sum(leaves[i].size for i in plan.exact)
  total = comm.allreduce_bytes(4 * exact, w) if exact else 0.0
  if plan.groups:
    total += (comm.compressed_bytes(codec, p, w, collective)
              + comm.compressed_bytes(codec, q, w, collective))
  return total


def lq_sgd(rank: int, bits: int = 8, alpha: float = 10.0, block: int | None = 256,
           collective: str = "two_phase", warm_start: bool = True,
           memory: str | _memory.ErrorMemory | None = "ef",
           start_iter: int = 0, min_compression_rate: float = 2,
           orthogonalization_epsilon: float = 0.0, batch_same_shape: bool = True,
           axis_name: comm.AxisName = "data", key: jax.Array | None = None, *,
           param_specs: Any = None) -> optax.GradientTransformation:
  """PowerSGD (see `powersgd`) whose factors P and Q travel as log-quantised codes.

  q(x) = sign(x) log(1 + alpha |x| / s) / log(1 + alpha) with s the block's largest
  magnitude (`codecs.log_quant(bits, alpha, block=block)`). Codes do not sum, so the factors
  travel through `collective`: "gather" (all-gather, decode each, sum in float32) or
  "two_phase" (all-to-all of coded chunks, float32 sum on the owner, re-encode, all-gather).
  Error feedback is on G: e_w <- M_w - P^ D(C(Q_w))^T, the local Q as it was sent. Tensors
  with ndim <= 1 are averaged exactly in float32.

  Args:
    rank: r >= 1.
    bits: code width including the sign bit, 2..16.
    alpha: log curvature, > 0.
    block: elements per float32 scale (None: one per vector / chunk).
    collective: "gather" or "two_phase".
    warm_start: as in `powersgd`, and so are memory, start_iter, min_compression_rate,
      orthogonalization_epsilon, batch_same_shape, axis_name, key and param_specs (with
      sharded gradients the whole-matrix view needs the same small inner-axis collectives).

  Returns:
    An `optax.GradientTransformation` with `PowerSGDState` state.

  References:
    LQ-SGD, arXiv 2506.17974; Vogels et al., PowerSGD, arXiv 1905.13727.

  >>> import jax.numpy as jnp
  >>> tx = lq_sgd(rank=1, bits=8, min_compression_rate=0, axis_name=None)
  >>> g = {"w": jnp.outer(jnp.arange(1., 4.), jnp.arange(1., 5.))}
  >>> updates, state = tx.update(g, tx.init(g))
  >>> bool(jnp.allclose(updates["w"], g["w"], rtol=0.05))
  True
  """
  _powersgd.check_rank(rank)
  memory, key = _powersgd.check_common(memory, start_iter, min_compression_rate,
                                       orthogonalization_epsilon, key, "sync.lq_sgd")
  bits = v.integer("bits", bits, low=2, high=16)
  collective = v.one_of("collective", collective, LQ_COLLECTIVES)  # log codes do not sum
  codec = codecs.log_quant(bits, alpha, block=block)
  return _powersgd.low_rank(rank, warm_start=warm_start, memory=memory,
                            start_iter=start_iter, min_compression_rate=min_compression_rate,
                            orthogonalization_epsilon=float(orthogonalization_epsilon),
                            batch_same_shape=batch_same_shape, axis_name=axis_name, key=key,
                            codec=codec, collective=collective, param_specs=param_specs)
