"""1-bit Adam: exact Adam for a warm-up, then frozen variance and 1-bit momentum."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm
from jaxcomm.sync import _memory


class OnebitAdamState(NamedTuple):
  """State of `onebit_adam`; vectors are the flattened parameters (n elements)."""
  count: jax.Array         # int32[]: updates done
  mu: jax.Array            # f32[n]: momentum (the same on all workers)
  nu: jax.Array            # f32[n]: variance, frozen from freeze_step on (the same on all workers)
  worker_error: jax.Array  # f32[n], per worker: error of this worker's 1-bit momentum
  server_error: jax.Array  # f32[n], per worker: error of the chunk it reduces (its slots only)
  wire_bytes: jax.Array    # u32[]: cumulative bytes sent by this device (mod 2**32)


def onebit_adam_bytes(n: int, w: int, freeze_step_passed: bool, block: int | None = None) -> float:
  """Wire bytes per device of one step: an f32 all-reduce before freeze_step, else the
  two-phase all-reduce of 1-bit codes (2(W-1) * payload_bytes(ceil(n / W))).

  Example:
    >>> onebit_adam_bytes(1024, 8, False), onebit_adam_bytes(1024, 8, True)  # f32, then 1 bit
    (7168.0, 280.0)
  """
  if not freeze_step_passed:
    return comm.allreduce_bytes(4 * n, w) if w > 1 else 0.0
  return comm.compressed_bytes(codecs.sign(block=block), n, w, "two_phase")


def onebit_adam(learning_rate: float | optax.Schedule, freeze_step: int, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8, block: int | None = None,
                axis_name: comm.AxisName = "data") -> optax.GradientTransformation:
  """Adam whose momentum travels as 1 bit per element once the variance is frozen.

  Steps t < freeze_step: the exact gradient mean g (f32 all-reduce), then Adam with bias
  correction. From freeze_step on, v (and its bias correction) stay frozen; each worker forms
  m_w = b1 m + (1 - b1) g_w from its LOCAL gradient and the momentum is averaged by the
  two-phase compressed all-reduce of `codecs.sign` (1 bit and a float32 scale per block):
  worker w sends C(m_w + e_w) and keeps e_w <- m_w + e_w - D(C(m_w + e_w)); the owner of
  chunk r sums the decoded chunks, adds its server error, re-encodes and keeps that error.
  The decoded mean is the new m on every worker; the update is -lr m_hat / (sqrt(v_hat) + eps).
  Bias correction of m continues after the freeze (it tends to 1). Coordinates whose frozen
  v is 0 are never moved (exact Adam would not move them; a 1-bit code cannot send 0).
  This is a complete optimiser: do not chain another one after it. Sharded gradients
  (`parallel.Layout.optimizer`): per shard, the sign scales are over this device's shards.

  Args:
    learning_rate: a float or an optax schedule of the update count.
    freeze_step: warm-up steps with exact Adam, >= 0.
    b1, b2, eps: Adam's constants.
    block: elements per scale of the sign codec inside each chunk (None: one per chunk, as
      DeepSpeed).
    axis_name: the data axis; None for one device.

  Returns:
    An `optax.GradientTransformation` whose state keeps m, v, both error memories and the
    wire bytes.

  References:
    Tang et al., 1-bit Adam, arXiv 2102.02888.

  >>> import jax.numpy as jnp
  >>> tx = onebit_adam(0.1, freeze_step=1, axis_name=None)
  >>> g = {"w": jnp.array([1., -2.])}
  >>> updates, state = tx.update(g, tx.init(g))
  >>> [round(float(u), 4) for u in updates["w"]]  # Adam's first step: -lr sign(g)
  [-0.1, 0.1]
  """
  freeze_step = v.integer("freeze_step", freeze_step, low=0)
  b1 = v.number("b1", b1, low=0.0, high=1.0, high_open=True)
  b2 = v.number("b2", b2, low=0.0, high=1.0, high_open=True)
  eps = v.number("eps", eps, low=0.0, low_open=True)
  codec = codecs.sign(block=block)
  # The worker's memory is error feedback on its momentum (the same record as memory="ef"
  # elsewhere); the server's is the two-phase collective's own (comm.compressed_sum's
  # server_memory), which lives below sync and is not an ErrorMemory.
  worker = _memory.resolve_memory("ef", stage="sync.onebit_adam")
  lr = learning_rate if callable(learning_rate) else (lambda _: learning_rate)

  def init_fn(params):
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    zeros = jnp.zeros((n,), jnp.float32)
    return OnebitAdamState(count=jnp.zeros((), jnp.int32), mu=zeros, nu=zeros,
                           worker_error=worker.init(n), server_error=zeros,
                           wire_bytes=comm.zero_bytes())

  def adam_branch(g, state):
    mean, nbytes = comm.mean(g, axis_name)
    mu = b1 * state.mu + (1 - b1) * mean
    nu = b2 * state.nu + (1 - b2) * mean * mean
    return mu, nu, state.worker_error, state.server_error, nbytes

  def onebit_branch(g, state):
    sent = worker.send(state.worker_error, b1 * state.mu + (1 - b1) * g)
    out, nbytes = comm.compressed_sum(sent, codec, axis_name, "two_phase",
                                      server_memory=state.server_error)
    mu = out.total / comm.axis_size(axis_name)
    return (mu, state.nu, worker.keep(state.worker_error, sent, out.own), out.server_memory,
            nbytes)

  def update_fn(updates, state, params=None):
    comm.require_varying(updates, axis_name, "sync.onebit_adam")
    del params
    g, unflatten = codecs.flatten(updates)
    t = state.count + 1

    def run(branch):
      mu, nu, we, se, nbytes = branch(g, state)
      return mu, nu, we, se, comm.add_bytes(state.wire_bytes, nbytes)

    if freeze_step > 0:
      # comm.cond: the branches' outputs vary over different axes (the 1-bit branch's error
      # memories over the workers, a sharded gradient's moments over its shard axes).
      mu, nu, we, se, counter = comm.cond(state.count < freeze_step, lambda: run(adam_branch),
                                          lambda: run(onebit_branch))
    else:
      mu, nu, we, se, counter = run(onebit_branch)
    # The variance's bias correction freezes with it.
    t_nu = jnp.minimum(t, max(freeze_step, 1)).astype(jnp.float32)
    mu_hat = mu / (1 - b1 ** t.astype(jnp.float32))
    nu_hat = nu / (1 - b2 ** t_nu)
    # v = 0 means no gradient ever reached the coordinate before the freeze (e.g. a blank
    # input pixel): exact Adam leaves it alone (m = 0 too), but the 1-bit code cannot say 0,
    # so it would be moved by lr * scale / eps. Keep it still.
    step = jnp.where(nu > 0, -lr(state.count) * mu_hat / (jnp.sqrt(nu_hat) + eps), 0.0)
    new_state = OnebitAdamState(count=t, mu=mu, nu=nu, worker_error=we, server_error=se,
                                wire_bytes=counter)
    return unflatten(step), new_state

  return optax.GradientTransformation(init_fn, update_fn)

