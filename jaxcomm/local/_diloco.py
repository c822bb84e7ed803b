"""DiLoCo: an inner optimiser on each worker, an outer optimiser on the averaged progress."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm, sync
from jaxcomm.local import _core
from jaxcomm.local import _periodic
from jaxcomm.local import _transport

WEIGHTINGS = ("uniform", "tokens")


class DilocoState(NamedTuple):
  """State of `diloco`."""
  count: jax.Array       # i32[]: inner steps taken
  inner_state: Any       # the inner optimiser's state (per-worker)
  outer_params: Any      # like params: the outer (global) parameters θ_out (replicated)
  outer_state: Any       # the outer optimiser's state (replicated)
  memory: Any            # f32[n] error memory of the encoded outer gradient (per-worker);
                         # None without
  key: jax.Array         # u32[2]: PRNG key shared by all workers, for stochastic codecs
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)
  # Eager updates only (None otherwise); outer_params and outer_state are then per-worker.
  in_flight: Any = None  # like params: the mean outer gradient of the last sync (replicated)
  sent: Any = None       # like params: this worker's share of it, w_w δ_w / Σ w (per-worker)


def outer_gradient(outer_params: Any, local: Any, mine: jax.Array, row: jax.Array,
                   n_live: jax.Array, memory: jax.Array, key: jax.Array,
                   codec: codecs.CodecLike | None, axis_name,
                   error: sync.ErrorMemory | None = None,
                   collective: str | None = None) -> tuple[Any, jax.Array, float]:
  """Δ = θ_out − mean over live workers of θ_w, optionally encoded with an error memory.

  Each worker sends its own δ_w = θ_out − θ_w (small numbers, which is what a codec should
  see). Returns (Δ like params, new memory, wire bytes). A sync without a live worker gives
  Δ = 0. With an error memory (`error`, whose float32 buffer of n elements is `memory`) the
  worker sends C(p), p = error.send(e_w, δ_w), and keeps e_w ← error.keep(e_w, p, D(C(p)))
  (`sync.error_feedback(decay=β)`: p = δ_w + β e_w, e_w ← p − D(C(p))); a dropped worker
  keeps its memory. `collective`: how the codec's payloads travel
  (`_transport.COLLECTIVES`).
  """
  delta = jax.tree.map(jnp.subtract, outer_params, local)
  denom = jnp.maximum(n_live, 1.0)
  if codec is None:
    total, nbytes = comm.sum(jax.tree.map(lambda d: d * mine.astype(d.dtype), delta),
                             axis_name)
    return jax.tree.map(lambda s: s / denom.astype(s.dtype), total), memory, nbytes
  codec = codecs.for_tree(codec, delta)
  vec, unflatten = codecs.flatten(delta)
  if error is not None:
    vec = error.send(memory, vec)
  total, own, nbytes = _transport.codec_sum(codec, vec, key, mine, row, axis_name, collective)
  if error is not None:
    memory = jnp.where(mine > 0, error.keep(memory, vec, own), memory)
  return unflatten(total / denom), memory, nbytes


def eager_gradient(mean: Any, outer_params: Any, local: Any, mine: jax.Array,
                   n_live: jax.Array, in_flight: Any, sent: Any) -> tuple[Any, Any, Any]:
  """Eager outer gradient: (Δ̄_{k-1} + s_k − s_{k-1}, new in-flight mean, new share s_k).

  `mean` is sync k's mean outer gradient Δ̄_k, sent now and used at sync k + 1 (it becomes
  the in-flight value); s_k = (θ_out − θ_w) · mine / n_live is this worker's own share of
  it, which stands in at once for its part of the unknown mean, while its stale share
  s_{k-1} (`sent`) is swapped out of Δ̄_{k-1} (`in_flight`). Shared with Streaming DiLoCo,
  which calls it on one fragment.
  """
  share = jax.tree.map(
      lambda o, x: (o - x) * (mine / jnp.maximum(n_live, 1.0)).astype(x.dtype),
      outer_params, local)
  grad = jax.tree.map(lambda a, s, p: a + s - p, in_flight, share, sent)
  return grad, mean, share


def diloco(inner: optax.GradientTransformation, outer: optax.GradientTransformation,
           sync_every: int, axis_name: comm.AxisName = "data", *,
           codec: codecs.CodecLike | None = None, memory: str | sync.ErrorMemory | None = None,
           collective: str | None = None, participation: _core.Participation = None,
           key: jax.Array | None = None, eager: bool = False,
           worker_steps: Sequence[int] | None = None, weighting: str = "uniform",
           tokens_per_step: Sequence[float] | None = None
           ) -> optax.GradientTransformationExtraArgs:
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
    memory: the error memory of the encoded outer gradient (needs a codec): None, a
      `sync.ErrorMemory` or a name of `sync.resolve_memory` but "ef21" (nothing accumulates).
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
    eager: eager outer updates (the paper's "eager" variant, not its naive one-step delay):
      the all-reduce of sync k overlaps the next H inner steps, so its mean Δ̄_k is used at
      sync k + 1. Worker w steps the outer optimiser at once with
      Δ~_w,k = Δ̄_{k-1} + s_w,k − s_w,k-1, where s_w,k = δ_w,k / W is its own share of the
      mean being sent (w_w δ_w / Σ w with a mask or weights): its own fresh outer gradient
      stands in for its part of the unknown mean, the others' parts come one phase late,
      and its own stale part is swapped out. Outer parameters and outer state become
      per-worker; the bytes are DiLoCo's. With one worker it is DiLoCo. With a codec s_w
      is the unencoded δ_w.
    worker_steps: optional inner steps H_r in [1, H] per worker: worker r computes only the
      first H_r updates of each period of H (a slower replica), idle (parameters and inner
      state untouched) for the rest, and syncs with everyone after update H.
    weighting: "uniform" (every live worker's δ_w counts equally) or "tokens" (δ_w weighted
      by the tokens it processed since the last merge: H_r x `tokens_per_step[r]`).
    tokens_per_step: optional tokens per inner step of each worker (default 1 each); used by
      `weighting="tokens"` only.

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Douillard et al., DiLoCo, arXiv 2311.08105. Kale et al., Eager Updates For Overlapped
    Communication and Computation in DiLoCo, arXiv 2502.12996. Token-weighted merges of
    replicas of different speed: Decoupled DiLoCo, arXiv 2604.21428.

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
  error = sync.resolve_memory(memory, accumulate=False, one_buffer=True, stage="local.diloco")
  if error is not None and codec is None:
    raise ValueError(f"memory={memory!r} needs a codec (error feedback of what?).")
  collective = _transport.check_collective(collective, codec)
  key = v.key("key", key)
  eager = v.flag("eager", eager)
  weighting = v.one_of("weighting", weighting, WEIGHTINGS)
  steps = _core.check_worker_steps(worker_steps, sync_every)
  tokens = _per_worker("tokens_per_step", tokens_per_step, lambda n, x: v.number(
      n, x, low=0.0, low_open=True))
  if steps is not None and tokens is not None and steps.size != tokens.size:
    raise ValueError(f"worker_steps has {steps.size} workers but tokens_per_step has "
                     f"{tokens.size}.")
  weights = None
  if weighting == "tokens" and (steps is not None or tokens is not None):
    # Each worker's δ_w weighted by the tokens of its period: H_r x tokens_per_step[r].
    weights = np.ones((steps if steps is not None else tokens).size, np.float32)
    if steps is not None:
      weights = weights * steps
    if tokens is not None:
      weights = weights * tokens
  return build(inner, outer, sync_every, axis_name, codec=codec,
               memory=error, live_fn=live_fn,
               key=key, name="diloco", collective=collective, eager=eager,
               steps=steps, weights=weights)


def _per_worker(name: str, values, check) -> np.ndarray | None:
  """None, or one checked value per worker as an array (ValueError naming `name`)."""
  if values is None:
    return None
  if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not len(values):
    raise ValueError(f"{name} must be a non-empty list with one value per worker; got "
                     f"{values!r}.")
  return np.asarray([check(name, x) for x in values])


def build(inner, outer, sync_every: int, axis_name, *, codec,
          memory: sync.ErrorMemory | None, live_fn, key: jax.Array, name: str,
          collective: str | None = None, eager: bool = False, steps=None,
          weights=None) -> optax.GradientTransformationExtraArgs:
  """The DiLoCo transform from checked arguments (shared with `sparseloco`); `key`: raw data.

  `memory`: the outer gradient's error memory (float32 buffers: `sync.error_feedback`'s),
  or None. `steps`, `weights`: `periodic`'s worker_steps and worker_weights.
  """

  def init_fn(params):
    if codec is not None:
      codecs.for_tree(codec, params)  # a bad codec or factory fails here, before any step
    n = sum(x.size for x in jax.tree.leaves(params))
    zeros = lambda: jax.tree.map(jnp.zeros_like, params) if eager else None
    return dict(outer_params=jax.tree.map(jnp.asarray, params), outer_state=outer.init(params),
                memory=None if memory is None else memory.init(n), in_flight=zeros(),
                sent=zeros())

  def outer_step(local, state, sync):
    grad, mem, nbytes = outer_gradient(state.outer_params, local, sync.mine, sync.weights,
                                       sync.total, state.memory, sync.key, codec, axis_name,
                                       memory, collective)
    in_flight, sent = state.in_flight, state.sent
    if eager:
      grad, in_flight, sent = eager_gradient(grad, state.outer_params, local, sync.mine,
                                             sync.total, in_flight, sent)
    step, outer_state = outer.update(grad, state.outer_state, state.outer_params)
    outer_params = optax.apply_updates(state.outer_params, step)
    return outer_params, state._replace(outer_params=outer_params, outer_state=outer_state,
                                        memory=mem, in_flight=in_flight, sent=sent), nbytes

  return _periodic.periodic(inner, sync_every, outer_step, init_fn=init_fn,
                            state_type=DilocoState, axis_name=axis_name,
                            participation=live_fn, worker_steps=steps,
                            worker_weights=weights, key=key, name=name)
