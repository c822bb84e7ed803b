"""DiLoCo: an inner optimiser on each worker, an outer optimiser on the averaged progress."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm
from jaxcomm.local import _core
from jaxcomm.local import _transport

MEMORIES = (None, "ef")


class DilocoState(NamedTuple):
  """State of `diloco`."""
  count: jax.Array       # i32[]: inner steps taken
  inner_state: Any       # the inner optimiser's state (per-worker)
  outer_params: Any      # like params: the outer (global) parameters θ_out (replicated)
  outer_state: Any       # the outer optimiser's state (replicated)
  memory: Any            # f32[n] error memory of the encoded outer gradient (per-worker); None without
  key: jax.Array         # u32[2]: PRNG key shared by all workers, for stochastic codecs
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)


def outer_gradient(outer_params: Any, local: Any, mine: jax.Array, row: jax.Array,
                   n_live: jax.Array, memory: jax.Array, key: jax.Array,
                   codec: codecs.CodecLike | None, axis_name, decay: float = 1.0,
                   collective: str | None = None) -> tuple[Any, jax.Array, float]:
  """Δ = θ_out − mean over live workers of θ_w, optionally encoded with error feedback.

  Each worker sends its own δ_w = θ_out − θ_w (small numbers, which is what a codec should
  see). Returns (Δ like params, new memory, wire bytes). A sync without a live worker gives
  Δ = 0. With a memory (f32[n], not None) the worker sends C(δ_w + β e_w) and keeps
  e_w ← δ_w + β e_w − D(C(δ_w + β e_w)), β = `decay`; a dropped worker keeps its memory.
  `collective`: how the codec's payloads travel (`_transport.COLLECTIVES`).
  """
  delta = jax.tree.map(jnp.subtract, outer_params, local)
  denom = jnp.maximum(n_live, 1.0)
  if codec is None:
    total, nbytes = comm.sum(jax.tree.map(lambda d: d * mine.astype(d.dtype), delta),
                             axis_name)
    return jax.tree.map(lambda s: s / denom.astype(s.dtype), total), memory, nbytes
  codec = codecs.for_tree(codec, delta)
  vec, unflatten = codecs.flatten(delta)
  if memory is not None:
    vec = vec + decay * memory
  total, own, nbytes = _transport.codec_sum(codec, vec, key, mine, row, axis_name, collective)
  if memory is not None:
    memory = jnp.where(mine > 0, vec - own, memory)
  return unflatten(total / denom), memory, nbytes


def diloco(inner: optax.GradientTransformation, outer: optax.GradientTransformation,
           sync_every: int, axis_name: comm.AxisName = "data", *,
           codec: codecs.CodecLike | None = None, memory: str | None = None,
           collective: str | None = None, participation: _core.Participation = None,
           key: jax.Array | None = None) -> optax.GradientTransformationExtraArgs:
  """DiLoCo: H inner steps per worker, then one outer step on the averaged progress.

  The state keeps the outer parameters θ_out and the outer optimiser's state. On every H-th
  update each worker has taken H inner steps from θ_out; the outer gradient is
  Δ = θ_out − mean_w θ_w (one all-reduce of |θ| values, or of the codec's payload), the
  outer optimiser steps θ_out, and the returned updates move every worker to the new θ_out.
  Bytes are counted in the sync branch only, so the per-step average is |θ|-all-reduce / H.

  With H = 1, inner SGD(lr) and outer SGD(1.0) this is exact data parallelism up to float
  rounding: θ_out − (θ_out − mean_w(θ_out − lr g_w)) instead of θ − lr mean_w g_w, a few
  ulps of θ per step (tests hold 1e-6).

  Sharded parameters (a replica laid out over fsdp / tensor, `parallel.Layout.optimizer`):
  element-wise, so each device syncs its shards and the outer parameters and state are
  stored sharded like the parameters; equal to unsharded replicas. A codec acts per shard.

  Args:
    inner: the optimiser each worker runs (AdamW in the paper); its state persists.
    outer: the outer optimiser (Nesterov SGD, lr 0.7, momentum 0.9 in the paper; SGD(1.0)
      is FedAvg).
    sync_every: H >= 1, inner steps between outer steps.
    axis_name: the mesh axis (or tuple of axes) of the workers; None for one device.
    codec: optional `jaxcomm.codecs.Codec` for the outer gradient, or a factory `shapes ->
      Codec` of the parameters' leaf shapes (`jaxcomm.codecs.for_tree`). Linear codecs
      (identity, cast) are summed in their wire type; others travel by gather.
    memory: None or "ef" (error feedback on the encoded outer gradient; needs a codec).
    collective: how the codec's payloads travel: None (as above), "gather" (every worker
      receives the W-1 other payloads: (W-1) P bytes, each payload decoded exactly) or
      "two_phase" (all-to-all of encoded chunks, each chunk's owner sums and re-encodes it,
      all-gather: 2(W-1)/W P bytes, the sum encoded a second time). Two-phase keeps a
      codec's saving as W grows; it needs a codec that may be cut into chunks.
    participation: optional live-worker mask per sync: bool[num_syncs, W] (rows past the end
      all live) or a traceable `fn(sync_index) -> bool[W]`. The outer gradient averages the
      live workers only; every worker, live or not, continues from the new θ_out.
    key: PRNG key of stochastic codecs (shared by all workers); None is the fixed default
      `jax.random.key(0)`.

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Douillard et al., DiLoCo, arXiv 2311.08105.

  >>> import jax.numpy as jnp, optax
  >>> tx = diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=1, axis_name=None)
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> optax.apply_updates(params, updates)["w"], state.outer_params["w"]
  (Array([0.9, 0.9], dtype=float32), Array([0.9, 0.9], dtype=float32))
  """
  inner, sync_every, axis_name, live_fn = _core.schedule_args(inner, sync_every, axis_name,
                                                              participation)
  outer = v.transform("outer", outer)
  codec = _transport.check_codec(codec)
  memory = v.one_of("memory", memory, MEMORIES)
  if memory is not None and codec is None:
    raise ValueError(f"memory={memory!r} needs a codec (error feedback of what?).")
  collective = _transport.check_collective(collective, codec)
  key = v.key("key", key)
  return build(inner, outer, sync_every, axis_name, codec=codec, memory=memory is not None,
               decay=1.0, live_fn=live_fn, key=key, name="diloco", collective=collective)


def build(inner, outer, sync_every: int, axis_name, *, codec, memory: bool, decay: float,
          live_fn, key: jax.Array, name: str, collective: str | None = None
          ) -> optax.GradientTransformationExtraArgs:
  """The DiLoCo transform from checked arguments (shared with `sparseloco`); `key`: raw data."""
  phases = _core.Phases(sync_every, [0])

  def init_fn(params):
    if codec is not None:
      codecs.for_tree(codec, params)  # a bad codec or factory fails here, before any step
    n = sum(x.size for x in jax.tree.leaves(params))
    return DilocoState(
        count=jnp.zeros((), jnp.int32), inner_state=inner.init(params),
        outer_params=jax.tree.map(jnp.asarray, params), outer_state=outer.init(params),
        memory=jnp.zeros((n,), jnp.float32) if memory else None,
        key=key,
        wire_bytes=comm.zero_bytes())

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axis_name, f"local.{name}")
    _core.require_params(params, name)
    inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    local = optax.apply_updates(params, inner_updates)
    t = state.count + 1

    def sync(local, outer_params, outer_state, mem, key, wire):
      mine, row, n_live = _core.live_weights(live_fn, phases.sync_index(t), axis_name)
      key, sub = jax.random.split(key)
      grad, mem, nbytes = outer_gradient(outer_params, local, mine, row, n_live, mem, sub,
                                         codec, axis_name, decay, collective)
      step, outer_state = outer.update(grad, outer_state, outer_params)
      outer_params = optax.apply_updates(outer_params, step)
      return outer_params, outer_params, outer_state, mem, key, comm.add_bytes(wire, nbytes)

    new_local, outer_params, outer_state, mem, key, wire = comm.cond(
        phases.slot(t) >= 0, sync, lambda *ops: ops, local, state.outer_params,
        state.outer_state, state.memory, state.key, state.wire_bytes)
    return _core.updates_to(new_local, params), DilocoState(
        t, inner_state, outer_params, outer_state, mem, key, wire)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
