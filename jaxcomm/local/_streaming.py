"""Streaming DiLoCo: DiLoCo one fragment at a time, overlapped, in low precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm
from jaxcomm.local import _cocodc
from jaxcomm.local import _core
from jaxcomm.local import _diloco
from jaxcomm.local import _fragments
from jaxcomm.local import _stale


def streaming_diloco(inner: optax.GradientTransformation, outer: optax.GradientTransformation,
                     sync_every: int, fragments: int = 1, overlap: int = 0, alpha: float = 0.5,
                     axis_name: comm.AxisName = "data", *,
                     codec: codecs.CodecLike | None | str = "auto",
                     collective: str | None = None,
                     participation: _core.Participation = None,
                     key: jax.Array | None = None,
                     compensation: str | None = None, dc_lambda: float = 1.0,
                     eager: bool = False
                     ) -> optax.GradientTransformationExtraArgs:
  """Streaming DiLoCo: fragments sync in turn, overlapped with inner steps, in low precision.

  The flattened parameters are dealt into P fragments like cards (element i to fragment
  i mod P), so every fragment holds an equal share of every layer and a sync sends exactly
  1/P of DiLoCo's bytes (up to padding). Fragment p syncs after update t when
  t mod H = p·H//P: Δ_p = θ_out,p − mean_w θ_w,p is all-reduced in the codec's wire type
  (accumulated in float32) and the fragment's outer optimiser steps θ_out,p. The result is
  merged τ = `overlap` updates later (the all-reduce overlapping compute):
  θ_w,p ← α θ_w,p + (1 − α) θ_out,p; a worker not live for the sync takes θ_out,p. With
  P = 1, τ = 0, α = 0 and no codec this is `diloco`.

  Sharded parameters: fragments are dealt from the flat vector of this device's shards; when
  P (and a block codec's block x P) divides every shard's last dimension, the run equals
  unsharded replicas.

  Args:
    inner: the optimiser each worker runs.
    outer: the outer optimiser; one state per fragment.
    sync_every: H >= 1, inner steps between two syncs of the same fragment.
    fragments: P, 1 <= P <= min(H, number of parameter leaves).
    overlap: τ in [0, H): updates between sending a fragment's outer gradient and merging.
    alpha: mixing weight of the local fragment at the merge, in [0, 1] (0.5 is the paper's
      reading, *unverified*).
    axis_name: the mesh axis (or tuple of axes) of the workers; None for one device.
    codec: "auto" (fp4 E2M1, `codecs.fp4()`), a `jaxcomm.codecs.Codec` or a factory
      `shapes -> Codec` (it sees `[(m,)]`: a fragment is one flat vector), or None (float32).
    collective: how the codec's payloads travel, as in `diloco` (None, "gather",
      "two_phase").
    participation: optional live-worker mask per sync (each fragment sync counts as one):
      bool[num_syncs, W] or `fn(sync_index) -> bool[W]`.
    key: PRNG key of stochastic codecs (shared by all workers); None is `jax.random.key(0)`.
    compensation: None, or "dc": the same as `cocodc(..., dc_lambda=dc_lambda)` (kept for
      existing configs; new code calls `cocodc`).
    dc_lambda: λ of `cocodc` (unused without compensation).
    eager: eager outer updates per fragment, as `diloco(..., eager=True)`: fragment p's
      all-reduce at its sync k overlaps the next H inner steps and its mean Δ̄_p,k is used at
      its sync k + 1; meanwhile worker w steps fragment p's outer optimiser at once with
      Δ̄_p,k-1 + s_w,p,k − s_w,p,k-1, s_w,p,k = δ_w,p,k / W its own share of the mean (the
      live-weighted share with a mask). Outer parameters and outer state become per-worker;
      the merge τ updates later mixes in this worker's eager θ_out,p. Bytes are unchanged.
      Not combined with compensation.

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Douillard et al., Streaming DiLoCo, arXiv 2501.18512. Kale et al., Eager Updates For
    Overlapped Communication and Computation in DiLoCo, arXiv 2502.12996.

  >>> import jax.numpy as jnp, optax
  >>> tx = streaming_diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, fragments=2,
  ...                       alpha=0.0, axis_name=None, codec=None)
  >>> tx.init({"a": jnp.ones(2), "b": jnp.ones(2)}).outer_params.shape
  (2, 2)
  """
  compensation = v.one_of("compensation", compensation, _stale.COMPENSATIONS)
  eager = v.flag("eager", eager)
  if eager and compensation is not None:
    raise ValueError(f"eager=True cannot be combined with compensation={compensation!r} "
                     f"(use compensation=None).")
  if compensation is not None:
    return _cocodc.cocodc(inner, outer, sync_every, fragments, overlap, alpha, axis_name,
                          codec=codec, collective=collective, participation=participation,
                          key=key, dc_lambda=dc_lambda)
  v.number("dc_lambda", dc_lambda, low=0)
  f = _fragments.Fragments("streaming_diloco", inner, outer, sync_every, fragments, overlap, alpha,
                axis_name, codec, collective, participation, key)

  def sync(local, state, sync):
    """Sends fragment p's outer gradient and steps its outer parameters."""
    p, grad, frag_local, nbytes = f.send(sync, local, state.outer_params)
    in_flight, sent = state.in_flight, state.sent
    if eager:  # DiLoCo's eager rule on row p
      grad, mean, share = _diloco.eager_gradient(grad, state.outer_params[p], frag_local,
                                                 sync.mine, sync.total, in_flight[p], sent[p])
      in_flight, sent = in_flight.at[p].set(mean), sent.at[p].set(share)
    outer_params, outer_state = f.outer_step(p, grad, state.outer_params, state.outer_state)
    return local, state._replace(outer_params=outer_params, outer_state=outer_state,
                                 in_flight=in_flight, sent=sent), nbytes

  def merge(local, state):
    """Fragment q, synced τ updates ago, mixed into the worker's parameters."""
    t = state.count
    local = comm.cond(f.merging(t), lambda x: f.merge(
        t, x, lambda q, *_: state.outer_params[q]), lambda x: x, local)
    return local, state

  return f.transform(sync, merge, **({"in_flight": jnp.zeros_like, "sent": jnp.zeros_like}
                                     if eager else {}))
