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
from jaxcomm.local import _stale
from jaxcomm.local import _transport


class StreamingDilocoState(NamedTuple):
  """State of `streaming_diloco` (P fragments of m elements each)."""
  count: jax.Array         # i32[]: inner steps taken
  inner_state: Any         # the inner optimiser's state (per-worker)
  outer_params: jax.Array  # f32[P, m]: θ_out, fragment p in row p (replicated)
  outer_state: Any         # the outer optimiser's state per fragment, leading axis P (replicated)
  key: jax.Array           # u32[2]: PRNG key shared by all workers, for stochastic codecs
  wire_bytes: jax.Array    # u32[]: cumulative bytes sent (mod 2**32)
  # Delay compensation only (None otherwise): the outer step of a fragment waits for the
  # arrival of its outer gradient, and each worker remembers what it sent.
  in_flight: Any = None    # f32[P, m]: row p, fragment p's last outer gradient Δ_p (replicated)
  sent_params: Any = None  # f32[P, m]: row p, θ_w,p when fragment p last synced (per-worker)


def default_codec() -> codecs.Codec:
  """The paper's outer-gradient codec: 4-bit floats (E2M1, `codecs.fp4()`)."""
  return codecs.fp4()


def _fragments(vec: jax.Array, num: int) -> jax.Array:
  """f32[n] -> f32[P, m]: element i goes to fragment i mod P (zero-padded)."""
  vec = jnp.pad(vec, (0, (-vec.shape[0]) % num))
  return vec.reshape(-1, num).T


def _unfragment(mat: jax.Array, n: int) -> jax.Array:
  return mat.T.reshape(-1)[:n]


def streaming_diloco(inner: optax.GradientTransformation, outer: optax.GradientTransformation,
                     sync_every: int, fragments: int = 1, overlap: int = 0, alpha: float = 0.5,
                     axis_name: comm.AxisName = "data", *,
                     codec: codecs.CodecLike | None | str = "auto",
                     collective: str | None = None,
                     participation: _core.Participation = None,
                     key: jax.Array | None = None,
                     compensation: str | None = None, dc_lambda: float = 1.0
                     ) -> optax.GradientTransformationExtraArgs:
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

  With `compensation="dc"` (CoCoDC, arXiv 2504.17672) the merge corrects the stale global
  update for the worker's progress while it was in flight. The paper compensates with a
  first-order Taylor expansion of the DC-ASGD form; its exact formula is *unverified* here,
  and this is the reading chosen: Δ_p is the outer gradient computed at the worker's
  fragment θ_w,p(t) of the send, applied τ inner steps later when the worker holds
  θ_w,p(t + τ), so each worker corrects it as DC-ASGD corrects a stale gradient
  (`delay_compensation`): Δ~_p = Δ_p + λ Δ_p ⊙ Δ_p ⊙ (θ_w,p(t + τ) − θ_w,p(t)), steps the
  outer optimiser with Δ~_p from the fragment's (θ_out,p, outer state) and merges the result
  in place of θ_out,p. The replicated θ_out,p and outer state still step with Δ_p, so all
  workers keep one global model, and the correction is local: the same bytes travel. The
  outer step of a fragment then happens on arrival instead of at the send (the same values:
  nothing else touches fragment p in between, as τ < H), so `outer_params` of a fragment in
  flight is its value before the step. Extra state: Δ_p of every fragment (replicated) and
  θ_w,p(t) (per worker), |θ| each. λ = 0 or τ = 0 gives plain streaming. The correction is
  not clipped: it grows as λ Δ_p ⊙ Δ_p and a large λ diverges. CoCoDC's adaptive choice of
  the fragment to send is not implemented (fragments sync in the fixed order above).

  Sharded parameters (`parallel.Layout.optimizer`): per shard, fragments are dealt from
  the flat vector of this device's shards. When P (and a block codec's block x P) divides
  every shard's last dimension, element i of a tensor lands in the same fragment (and codec
  block) as unsharded, and the run equals unsharded replicas.

  Args:
    inner: the optimiser each worker runs.
    outer: the outer optimiser; one state per fragment.
    sync_every: H >= 1, inner steps between two syncs of the same fragment.
    fragments: P, 1 <= P <= min(H, number of parameter leaves).
    overlap: τ in [0, H): updates between sending a fragment's outer gradient and merging.
    alpha: mixing weight of the local fragment at the merge, in [0, 1] (0.5 is the paper's
      reading, *unverified*).
    axis_name: the mesh axis (or tuple of axes) of the workers; None for one device.
    codec: the outer gradient's codec: "auto" (fp4 E2M1, `codecs.fp4()`), a
      `jaxcomm.codecs.Codec` or a factory `shapes -> Codec` (a fragment travels as one flat
      vector, so the factory sees `[(m,)]`), or None for exact float32.
    collective: how the codec's payloads travel, as in `diloco`: None (linear codecs in
      their wire type, others by gather), "gather" or "two_phase" (2(W-1)/W of a payload
      per worker instead of W-1 payloads; the sum is encoded a second time).
    participation: optional live-worker mask per sync (each fragment sync counts as one):
      bool[num_syncs, W] (rows past the end all live) or `fn(sync_index) -> bool[W]`.
    key: PRNG key of stochastic codecs (shared by all workers); None is the fixed default
      `jax.random.key(0)`.
    compensation: None, or "dc" for CoCoDC-style delay compensation of the merge.
    dc_lambda: λ >= 0 of the compensation (unused without it). Δ_p is a sum of H inner
      steps, so Δ_p ⊙ Δ_p is far smaller than a gradient's square and λ is larger than
      DC-ASGD's (the default 1.0 is a placeholder, not the paper's value).

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Douillard et al., Streaming DiLoCo, arXiv 2501.18512.
    Zhu et al., Cross-region Model Training with Communication-Computation Overlapping and
    Delay Compensation (CoCoDC), arXiv 2504.17672.
    Zheng et al., Asynchronous SGD with Delay Compensation, arXiv 1609.08326.

  >>> import jax.numpy as jnp, optax
  >>> tx = streaming_diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, fragments=2,
  ...                       alpha=0.0, axis_name=None, codec=None)
  >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  >>> state = tx.init(params)
  >>> state.outer_params.shape
  (2, 2)
  >>> dc = streaming_diloco(optax.sgd(0.1), optax.sgd(1.0), 2, 2, overlap=1, axis_name=None,
  ...                       codec=None, compensation="dc", dc_lambda=1.0)
  >>> dc.init(params).sent_params.shape  # each worker's fragments as last sent
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
      raise ValueError(f"codec must be 'auto', a jaxcomm.codecs.Codec (or a factory of one) or "
                       f"None, got {codec!r}.")
    codec = default_codec()
  codec = _transport.check_codec(codec)
  collective = _transport.check_collective(collective, codec)
  key = v.key("key", key)
  compensation = v.one_of("compensation", compensation, _stale.COMPENSATIONS)
  dc_lambda = v.number("dc_lambda", dc_lambda, low=0)
  phases = _core.Phases(sync_every, [p * sync_every // fragments for p in range(fragments)])

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    if fragments > len(leaves):
      raise ValueError(f"fragments ({fragments}) must be <= the number of parameter leaves "
                       f"({len(leaves)}).")
    outer_params = _fragments(codecs.flatten(params)[0], fragments)
    if codec is not None:  # a fragment travels as one flat vector: a factory sees [(m,)]
      codecs.for_tree(codec, outer_params[0])
    extra = {}
    if compensation is not None:
      extra = dict(in_flight=jnp.zeros_like(outer_params), sent_params=outer_params)
    return StreamingDilocoState(
        count=jnp.zeros((), jnp.int32), inner_state=inner.init(params),
        outer_params=outer_params, outer_state=jax.vmap(outer.init)(outer_params),
        key=key, wire_bytes=comm.zero_bytes(), **extra)

  def send(t, local, outer_params, key, wire):
    """All-reduces fragment p's outer gradient: (p, Δ_p, this worker's θ_w,p, key, wire)."""
    p = phases.slot(t)
    mine, row, n_live = _core.live_weights(live_fn, phases.sync_index(t), axis_name)
    frag_local = _fragments(codecs.flatten(local)[0], fragments)[p]
    key, sub = jax.random.split(key)
    grad, _, nbytes = _diloco.outer_gradient(outer_params[p], frag_local, mine, row, n_live,
                                             None, sub, codec, axis_name,
                                             collective=collective)
    return p, grad, frag_local, key, comm.add_bytes(wire, nbytes)

  def outer_step(p, grad, outer_params, outer_state):
    """Steps fragment p's outer parameters with the outer gradient `grad`."""
    frag_state = jax.tree.map(lambda x: x[p], outer_state)
    step, frag_state = outer.update(grad, frag_state, outer_params[p])
    outer_params = outer_params.at[p].set(optax.apply_updates(outer_params[p], step))
    outer_state = jax.tree.map(lambda x, y: x.at[p].set(y), outer_state, frag_state)
    return outer_params, outer_state

  def sync(t, local, outer_params, outer_state, key, wire):
    """Sends fragment p's outer gradient and steps its outer parameters."""
    p, grad, _, key, wire = send(t, local, outer_params, key, wire)
    return (*outer_step(p, grad, outer_params, outer_state), key, wire)

  def merge(t, local, target_fn):
    """Mixes fragment q, synced `overlap` updates ago, into the worker's parameters.

    `target_fn(q, mine, θ_w,q)` gives the fragment's synchronised value.
    """
    q = phases.slot(t - overlap)
    mine, _, _ = _core.live_weights(live_fn, phases.sync_index(t - overlap), axis_name)
    vec, unflatten = codecs.flatten(local)
    mat = _fragments(vec, fragments)
    a = jnp.where(mine > 0, alpha, 0.0)
    mat = mat.at[q].set(a * mat[q] + (1.0 - a) * target_fn(q, mine, mat[q]))
    return unflatten(_unfragment(mat, vec.shape[0]))

  def update_plain(t, local, state):
    outer_params, outer_state, key, wire = comm.cond(
        phases.slot(t) >= 0, lambda *ops: sync(t, local, *ops), lambda *ops: ops,
        state.outer_params, state.outer_state, state.key, state.wire_bytes)
    local = comm.cond(phases.slot(t - overlap) >= 0,
                       lambda x: merge(t, x, lambda q, *_: outer_params[q]), lambda x: x,
                       local)
    return local, StreamingDilocoState(t, None, outer_params, outer_state, key, wire)

  def update_compensated(t, local, state):
    """The outer step waits for arrival, when each worker also steps a compensated copy."""

    def keep(*ops):
      return ops

    def store(key, wire, in_flight, sent):
      p, grad, frag_local, key, wire = send(t, local, state.outer_params, key, wire)
      return key, wire, in_flight.at[p].set(grad), sent.at[p].set(frag_local)

    key, wire, in_flight, sent = comm.cond(phases.slot(t) >= 0, store, keep, state.key,
                                            state.wire_bytes, state.in_flight,
                                            state.sent_params)

    def arrive(x, outer_params, outer_state):
      q = phases.slot(t - overlap)
      theta, frag_state = outer_params[q], jax.tree.map(lambda y: y[q], outer_state)
      new_params, new_state = outer_step(q, in_flight[q], outer_params, outer_state)

      def target(q, mine, now):
        # CoCoDC: Δ_q was computed at the worker's θ_w,q of the send and arrives after
        # `overlap` more inner steps moved the worker to `now`; the worker steps the outer
        # optimiser from the same (θ_out,q, state) with the compensated Δ_q. A worker that
        # was not live for the sync had no part in Δ_q and takes the global fragment.
        fixed = _stale.delay_compensation(in_flight[q], now, sent[q], dc_lambda)
        step, _ = outer.update(fixed, frag_state, theta)
        return jnp.where(mine > 0, optax.apply_updates(theta, step), new_params[q])

      return merge(t, x, target), new_params, new_state

    local, outer_params, outer_state = comm.cond(
        phases.slot(t - overlap) >= 0, arrive, keep, local, state.outer_params,
        state.outer_state)
    return local, StreamingDilocoState(t, None, outer_params, outer_state, key, wire,
                                       in_flight, sent)

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axis_name, "local.streaming_diloco")
    _core.require_params(params, "streaming_diloco")
    inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    local = optax.apply_updates(params, inner_updates)
    step = update_plain if compensation is None else update_compensated
    local, new_state = step(state.count + 1, local, state)
    return (_core.updates_to(local, params),
            new_state._replace(inner_state=inner_state))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
