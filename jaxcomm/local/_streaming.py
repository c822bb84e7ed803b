"""Streaming DiLoCo: DiLoCo one fragment at a time, overlapped, in low precision."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm
from jaxcomm.local import _core
from jaxcomm.local import _diloco
from jaxcomm.local import _transport


class StreamingDilocoState(NamedTuple):
  """State of `streaming_diloco` (P fragments of m elements each)."""
  count: jax.Array         # i32[]: inner steps taken
  inner_state: Any         # the inner optimiser's state (per-worker)
  outer_params: jax.Array  # f32[P, m]: θ_out, fragment p in row p (replicated)
  outer_state: Any         # the outer optimiser's state per fragment, leading axis P (replicated)
  key: jax.Array           # u32[2]: PRNG key shared by all workers, for stochastic codecs
  wire_bytes: jax.Array    # u32[]: cumulative bytes sent (mod 2**32)


def default_codec() -> codecs.Codec:
  """4-bit floats (E2M1) when `jaxcomm.codecs` has them, else bfloat16."""
  fp4 = getattr(codecs, "fp4", None)
  return fp4() if callable(fp4) else codecs.cast("bfloat16")


def _fragments(vec: jax.Array, num: int) -> jax.Array:
  """f32[n] -> f32[P, m]: element i goes to fragment i mod P (zero-padded)."""
  vec = jnp.pad(vec, (0, (-vec.shape[0]) % num))
  return vec.reshape(-1, num).T


def _unfragment(mat: jax.Array, n: int) -> jax.Array:
  return mat.T.reshape(-1)[:n]


def streaming_diloco(inner: optax.GradientTransformation, outer: optax.GradientTransformation,
                     sync_every: int, fragments: int = 1, overlap: int = 0, alpha: float = 0.5,
                     axis_name: comm.AxisName = "data", *,
                     codec: codecs.Codec | None | str = "auto",
                     participation: _core.Participation = None, seed: int = 0
                     ) -> optax.GradientTransformation:
  """Streaming DiLoCo: fragments sync in turn, overlapped with inner steps, in low precision.

  The flattened parameters are dealt into P fragments like cards (element i to fragment
  i mod P), so every fragment holds an equal share of every layer: the striding across
  layers of the paper taken to its finest grain, which makes all fragments the same size
  and the peak bytes of a sync exactly 1/P of DiLoCo's (up to padding to a multiple of P).
  Fragment p syncs after update t when t mod H = p·H//P: its outer gradient
  Δ_p = θ_out,p − mean_w θ_w,p is all-reduced in the codec's wire type and accumulated in
  float32, and the fragment's outer optimiser steps θ_out,p. The result is merged
  `overlap` = τ updates later (the inner steps in between model the all-reduce overlapping
  compute): θ_w,p ← α θ_w,p + (1 − α) θ_out,p. A worker that was not live for the sync
  takes θ_out,p (α = 0 for it). With P = 1, τ = 0, α = 0 and no codec this is `diloco`.

  Args:
    inner: the optimiser each worker runs.
    outer: the outer optimiser; one state per fragment.
    sync_every: H >= 1, inner steps between two syncs of the same fragment.
    fragments: P, 1 <= P <= min(H, number of parameter leaves).
    overlap: τ in [0, H): updates between sending a fragment's outer gradient and merging.
    alpha: mixing weight of the local fragment at the merge, in [0, 1] (0.5 is the paper's
      reading, *unverified*).
    axis_name: the mesh axis (or tuple of axes) of the workers; None for one device.
    codec: the outer gradient's codec: "auto" (fp4 E2M1 when `jaxcomm.codecs` has it,
      bfloat16 otherwise), a `jaxcomm.codecs.Codec`, or None for exact float32.
    participation: optional live-worker mask per sync (each fragment sync counts as one):
      bool[num_syncs, W] (rows past the end all live) or `fn(sync_index) -> bool[W]`.
    seed: seed of the PRNG key for stochastic codecs.

  Returns:
    An `optax.GradientTransformation` that needs `params` in `update`.

  References:
    Douillard et al., Streaming DiLoCo, arXiv 2501.18512.

  >>> import jax.numpy as jnp, optax
  >>> tx = streaming_diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, fragments=2,
  ...                       alpha=0.0, axis_name=None, codec=None)
  >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  >>> state = tx.init(params)
  >>> state.outer_params.shape
  (2, 2)
  """
  inner, sync_every, axis_name, live_fn = _core.schedule_args(inner, sync_every, axis_name,
                                                              participation)
  outer = v.transform("outer", outer)
  # At most one fragment syncs per step (sync_every = H is the upper bound).
  fragments = v.integer("fragments", fragments, low=1, high=sync_every)
  overlap = v.integer("overlap", overlap, low=0, high=sync_every - 1)
  alpha = v.number("alpha", alpha, low=0.0, high=1.0)
  if isinstance(codec, str):
    if codec != "auto":
      raise ValueError(f"codec must be 'auto', a jaxcomm.codecs.Codec or None, got {codec!r}.")
    codec = default_codec()
  codec = _transport.check_codec(codec)
  seed = v.integer("seed", seed)
  phases = _core.Phases(sync_every, [p * sync_every // fragments for p in range(fragments)])

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    if fragments > len(leaves):
      raise ValueError(f"fragments ({fragments}) must be <= the number of parameter leaves "
                       f"({len(leaves)}).")
    outer_params = _fragments(codecs.flatten(params)[0], fragments)
    return StreamingDilocoState(
        count=jnp.zeros((), jnp.int32), inner_state=inner.init(params),
        outer_params=outer_params, outer_state=jax.vmap(outer.init)(outer_params),
        key=jax.random.PRNGKey(seed), wire_bytes=comm.zero_bytes())

  def sync(t, local, outer_params, outer_state, key, wire):
    """Sends fragment p's outer gradient and steps its outer parameters."""
    p = phases.slot(t)
    mine, row, n_live = _core.live_weights(live_fn, phases.sync_index(t), axis_name)
    frag_local = _fragments(codecs.flatten(local)[0], fragments)[p]
    theta = outer_params[p]
    key, sub = jax.random.split(key)
    grad, _, nbytes = _diloco.outer_gradient(theta, frag_local, mine, row, n_live,
                                             jnp.zeros((0,), jnp.float32), sub, codec,
                                             axis_name)
    frag_state = jax.tree.map(lambda x: x[p], outer_state)
    step, frag_state = outer.update(grad, frag_state, theta)
    outer_params = outer_params.at[p].set(optax.apply_updates(theta, step))
    outer_state = jax.tree.map(lambda x, y: x.at[p].set(y), outer_state, frag_state)
    return outer_params, outer_state, key, comm.add_bytes(wire, nbytes)

  def merge(t, local, outer_params):
    """Mixes fragment q, synced `overlap` updates ago, into the worker's parameters."""
    q = phases.slot(t - overlap)
    mine, _, _ = _core.live_weights(live_fn, phases.sync_index(t - overlap), axis_name)
    vec, unflatten = codecs.flatten(local)
    mat = _fragments(vec, fragments)
    a = jnp.where(mine > 0, alpha, 0.0)
    mat = mat.at[q].set(a * mat[q] + (1.0 - a) * outer_params[q])
    return unflatten(_unfragment(mat, vec.shape[0]))

  def update_fn(updates, state, params=None):
    _core.require_params(params, "streaming_diloco")
    inner_updates, inner_state = inner.update(updates, state.inner_state, params)
    local = optax.apply_updates(params, inner_updates)
    t = state.count + 1
    outer_params, outer_state, key, wire = _core.cond(
        phases.slot(t) >= 0, lambda *ops: sync(t, local, *ops), lambda *ops: ops,
        state.outer_params, state.outer_state, state.key, state.wire_bytes)
    local = _core.cond(phases.slot(t - overlap) >= 0,
                       lambda x: merge(t, x, outer_params), lambda x: x, local)
    return _core.updates_to(local, params), StreamingDilocoState(
        t, inner_state, outer_params, outer_state, key, wire)

  return optax.GradientTransformation(init_fn, update_fn)
