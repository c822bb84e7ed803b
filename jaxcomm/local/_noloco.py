"""NoLoCo: DiLoCo-style outer steps without a global collective, by random pairs."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm import sync
from jaxcomm.local import _core
from jaxcomm.local import _periodic


class NolocoState(NamedTuple):
  """State of `noloco`."""
  count: jax.Array       # i32[]: inner steps taken
  inner_state: Any       # the inner optimiser's state (per-worker)
  outer_params: Any      # like params: this worker's outer parameters φ_i (per-worker)
  momentum: Any          # like params: this worker's outer momentum δ_i (per-worker)
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)


def noloco(inner: optax.GradientTransformation, sync_every: int,
           axis_name: comm.AxisName = "data", *, outer_lr: float = 0.7,
           momentum: float = 0.5, gamma: float = 0.7, matchings: int = 8, seed: int = 0,
           participation: _core.Participation = None
           ) -> optax.GradientTransformationExtraArgs:
  """NoLoCo: H inner steps, then an outer momentum step averaged with one random partner.

  Every worker i keeps its own outer parameters φ_i and outer momentum δ_i (they are never
  all-reduced). After every H-th update worker i has the local parameters θ_i and the outer
  gradient Δ_i = φ_i − θ_i; its partner j(i) in this outer step's pairing is given by a
  random perfect matching (`sync.random_matchings(W, matchings, seed)`, phase k mod
  `matchings` at outer step k, the same on every worker). With β = `outer_lr`,
  α = `momentum`, γ = `gamma`:

      δ_i ← α δ_i − (β/2) (Δ_i + Δ_j) − γ (φ_i − (φ_i + φ_j)/2),   φ_i ← φ_i + δ_i,

  and worker i starts its next inner phase from φ_i. The pair term needs one message: each
  worker sends m_i = β Δ_i − γ φ_i to its partner (one `ppermute` of |θ| values), and
  (β Δ_i + γ φ_i + m_j)/2 is the bracket above. Bytes per outer step: |θ| b per worker.
  This is the paper's modified Nesterov step written with the momentum kept as δ (heavy-ball
  form); with W = 2, γ = 0 it is DiLoCo with outer `optax.sgd(β, momentum=α)`.

  Args:
    inner: the optimiser each worker runs.
    sync_every: H >= 1, inner steps between outer steps.
    axis_name: the mesh axis (or tuple of axes) of the workers (an even number of them);
      None for one device (the partner is the worker itself).
    outer_lr: β > 0.
    momentum: α in [0, 1).
    gamma: γ >= 0, the pull of φ_i towards the pair's mean. The defaults (β, α, γ) =
      (0.7, 0.5, 0.7) are those of the authors' released code and configs (pairs,
      outer_lr 0.7, outer_momentum 0.5, 50 inner steps; their step applies outer_lr to the
      pull term too, so γ = β); they were not checked against the paper's text.
    matchings: how many random matchings are drawn (each is one branch of the compiled
      step); outer step k uses matching k mod `matchings`.
    seed: the seed of the matchings, shared by every worker.
    participation: optional live-worker mask per outer step: bool[num_outer_steps, W]
      (rows past the end all live) or a traceable `fn(k) -> bool[W]`. A dropped worker's
      inner phase is lost: it keeps φ_i and δ_i and restarts from φ_i. A live worker whose
      partner is dropped steps alone (its own message stands in for the partner's:
      δ_i ← α δ_i − β Δ_i). The ppermute still travels (a static collective), so the bytes
      are unchanged.

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Kolehmainen et al., NoLoCo: No-all-reduce Low Communication Training, arXiv 2506.10911.

  >>> import jax.numpy as jnp, optax
  >>> tx = noloco(optax.sgd(0.1), sync_every=1, axis_name=None, momentum=0.0)
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> state.outer_params["w"]  # φ − β Δ = 1 − 0.7 * 0.1
  Array([0.93, 0.93], dtype=float32)
  """
  inner, sync_every, axis_name, live_fn = _core.schedule_args(inner, sync_every, axis_name,
                                                              participation)
  outer_lr = v.number("outer_lr", outer_lr, low=0.0, low_open=True)
  momentum = v.number("momentum", momentum, low=0.0, high=1.0, high_open=True)
  gamma = v.number("gamma", gamma, low=0.0)
  matchings = v.integer("matchings", matchings, low=1, high=1024)
  seed = v.integer("seed", seed, low=0, high=2**31 - 1)
  axes = comm.axis_names(axis_name)

  @functools.lru_cache(maxsize=None)
  def pairs(num_workers: int) -> sync.GossipGraph:
    if num_workers % 2:
      raise ValueError(f"noloco pairs the workers: axis_name {axis_name!r} has "
                       f"{num_workers} workers, which is odd.")
    return sync.random_matchings(num_workers, matchings, seed)

  def partner_message(k, message, wire):
    """m_j of this worker's partner in matching k mod `matchings`, and the counter."""
    if not axes:
      return message, wire
    graph = pairs(comm.axis_size(axes))

    leaves, treedef = jax.tree.flatten(message)
    fuse = len({x.dtype for x in leaves}) == 1  # one buffer: one message, one latency

    def branch(p):
      def run(m, c):
        perm = [(int(s), i) for i, s in enumerate(graph.sources[p][0])]
        if fuse:
          flat = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(m)])
          received, nbytes = comm.ppermute(flat, axes, perm)
          parts = jnp.split(received, np.cumsum([x.size for x in leaves])[:-1])
          received = jax.tree.unflatten(
              treedef, [r.reshape(x.shape) for r, x in zip(parts, leaves)])
        else:
          received, nbytes = comm.ppermute(m, axes, perm)
        return received, comm.add_bytes(c, nbytes)
      return run

    return lax.switch(k % graph.period, [branch(p) for p in range(graph.period)],
                      message, wire)

  def live_pair(k, sync):
    """(bool[]: this worker is live, bool[]: it and its partner in matching k are live)."""
    mine, row = sync.mine, sync.weights
    if not axes:
      return mine > 0, mine > 0
    graph = pairs(comm.axis_size(axes))
    table = jnp.asarray(np.stack([s[0] for s in graph.sources]), jnp.int32)
    partner = table[k % graph.period, _core.worker_index(axis_name)]
    return mine > 0, (mine > 0) & (row[partner] > 0)

  def init_fn(params):
    return dict(outer_params=jax.tree.map(jnp.asarray, params),
                momentum=jax.tree.map(jnp.zeros_like, params))

  def outer_step(local, state, sync):
    k, phi, delta = sync.index, state.outer_params, state.momentum
    grad = jax.tree.map(jnp.subtract, phi, local)
    message = jax.tree.map(lambda g, f: outer_lr * g - gamma * f, grad, phi)
    # Bytes counted in the matching's own branch (one per matching).
    received, wire = partner_message(k, message, state.wire_bytes)
    mine, paired = live_pair(k, sync)
    received = jax.tree.map(lambda r, m: jnp.where(paired, r, m), received, message)
    new_delta = jax.tree.map(
        lambda d, g, f, m: momentum * d - 0.5 * (outer_lr * g + gamma * f + m),
        delta, grad, phi, received)
    # A dropped worker keeps its outer state (its inner phase is lost).
    phi = jax.tree.map(lambda f, n: jnp.where(mine, f + n, f), phi, new_delta)
    delta = jax.tree.map(lambda n, d: jnp.where(mine, n, d), new_delta, delta)
    return phi, state._replace(outer_params=phi, momentum=delta, wire_bytes=wire), 0

  return _periodic.periodic(inner, sync_every, outer_step, init_fn=init_fn,
                            state_type=NolocoState, axis_name=axis_name,
                            participation=live_fn, name="noloco")
