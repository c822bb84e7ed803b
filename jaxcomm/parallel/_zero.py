"""ZeRO: optimiser state (stages 1, 2) and parameters (stage 3) sharded over the data axis.

Stages 1 and 2 flatten the local gradient tree into one float32 vector (zero-padded to a
multiple of W: a few large collectives instead of one per leaf), reduce-scatter it so that
device r holds the summed chunk r, run the inner optimiser on that chunk only, and all-gather
the updated chunks: 2(W-1)/W N bytes, the same as a data-parallel all-reduce, with 1/W of the
optimiser state per device. The inner state is per worker (it differs between devices), so
the Trainer stores it with a leading worker axis sharded over the data axis: each device
holds only its own chunk's state.

The reduce-scatter takes any codec with optional error feedback: the encoded chunks travel by
one all-to-all and are decoded and summed in float32 by their owner
(`comm.reduce_scatter_encoded`), so compression composes with sharding. The parameter
all-gather takes a codec too (`gather_codec`): each device then keeps the exact float32
master copy of its chunk in the state, steps it, and all-gathers it encoded
(`comm.all_gather_encoded`); every device's parameters are the decoded gather.

ZeRO++ (arXiv 2306.10209) across replicas of a model sharded inside each replica: ZeRO-3
over the fast `fsdp` axis holds the parameters partitioned inside the replica (hpZ's
secondary partition: the backward re-gather of every layer stays on `fsdp`), and stage 1
over the slow `replica` axis holds the primary partition (the master chunk and the
optimiser state, 1/(R F) of the model per device) with the gradient reduce-scattered as
int8 codes with error feedback (qgZ) and the parameters all-gathered as int8 codes with
block scales (qwZ):

    zeropp = zero(optax.adamw(1e-3), 1, "replica", codecs.uniform(8, block=256), "ef",
                  gather_codec=codecs.uniform(8, block=256))
    tx = layout.optimizer(zeropp, specs, lm.param_regather())  # ZeRO-3 over fsdp around it

The slow axis then carries per step only the int8 reduce-scatter and the int8 gather:
(R-1)/R |θ|/F bytes each plus scales, against 3 (R F - 1)/(R F) |θ| float32 bytes of
ZeRO-3 over replica x fsdp. The forward gather of a layer's parameters over the slow axis
happens once per step, after the optimiser step, instead of in the next forward pass: the
same values and bytes, without the per-layer prefetch overlap. (The paper also quantises
the gathers and reduce-scatter inside the node; here the fsdp traffic stays float32.)

Stages 1 and 2 differ in where the gradient waits when several micro-batches are accumulated
(`accumulate_steps > 1`): stage 1 sums the whole local gradient and reduce-scatters once per
optimiser step; stage 2 reduce-scatters every micro-batch and keeps only the 1/W chunk it owns
(more bytes, 1/W of the gradient memory). With one micro-batch they compile to the same step.

Stage 3 keeps the parameters themselves sharded (by `param_specs`); the model gathers them
layer by layer (`jaxcomm.parallel.fsdp`) and its backward pass reduce-scatters the gradients,
so this transform only finishes the mean and runs the inner optimiser on the shards.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm import _validate as v
from jaxcomm import codecs
from jaxcomm import comm
from jaxcomm import sync
from jaxcomm.parallel import _validate
from jaxcomm.parallel._fsdp import gather_dims

class ZeroState(NamedTuple):
  """State of `zero`. N: parameter elements padded to a multiple of W."""
  inner_state: Any        # stages 1/2: inner state of this device's f32[N/W] chunk (per
                          # worker); stage 3: inner state of the parameter shards
  # Unused buffers are `optax.EmptyState()` (no leaves: checkpoints hold no empty arrays).
  error: Any              # [N] buffers per worker: the error memory of the encoded
                          # reduce-scatter (memory="ef": f32[N])
  accumulated: Any        # stage 1: f32[N] local gradient sum; stage 2: f32[N/W] reduced
                          # chunk sum; both per worker (when accumulate_steps > 1)
  count: jax.Array        # i32[]: micro-batches seen
  key: Any                # u32[2]: PRNG key of a stochastic codec
  wire_bytes: jax.Array   # u32[]: cumulative bytes sent (mod 2**32)
  master: Any = optax.EmptyState()  # stages 1/2 with a gather codec: f32[N/W] exact master
                                    # copy of this device's chunk of the parameters


def _flat_padded(tree, w):
  vec, unflatten = codecs.flatten(tree)
  n = vec.shape[0]
  return jnp.pad(vec, (0, -n % w)), (lambda v: unflatten(v[:n]))


def zero(inner: optax.GradientTransformation, stage: int = 1,
         axis_name: comm.AxisName = "data", codec: codecs.Codec | None = None,
         memory: str | sync.ErrorMemory | None = None, *, param_specs: Any = None,
         regather: Any = None, accumulate_steps: int = 1, key: jax.Array | None = None,
         gather_codec: codecs.Codec | None = None) -> optax.GradientTransformationExtraArgs:
  """ZeRO stage 1, 2 or 3 data parallelism around an inner optimiser.

  Args:
    inner: the optimiser run on each device's shard. Stages 1 and 2 give it one flat
      float32 chunk, so it must act element-wise (sgd, momentum, adam, adamw without a
      mask; not a global-norm clip, which would see only the chunk).
    stage: 1 (optimiser state sharded), 2 (gradients sharded too: matters with
      `accumulate_steps > 1`), or 3 (parameters sharded, gathered per layer by the model).
    axis_name: the data axis (or tuple of axes); None for one device.
    codec: stages 1/2: a `jaxcomm.codecs.Codec` for the gradient reduce-scatter (None:
      exact float32 `psum_scatter`). Any codec that works on any length: chunks are decoded
      before they are summed. Codecs that need the whole vector (a `length`, or made by a
      factory from the parameters' shapes) are refused.
    memory: the error memory of the encoded reduce-scatter (needs a codec): None, a
      `sync.ErrorMemory` or a name of `sync.resolve_memory` but "ef21" (nothing accumulates
      here). "ef": each worker keeps what its codec dropped and adds it to the next gradient.
    param_specs: stage 3: the PartitionSpecs the parameters are stored with (a tree like
      the parameters, e.g. `Layout.param_specs`); leaves sharded over `axis_name` arrive
      already reduce-scattered by the model's backward pass.
    regather: stage 3: the tree of bools the model's `fsdp` layers were given (which
      parameters are gathered again in the backward pass; e.g.
      `TransformerLM.param_regather()`); all by default. Used to count the bytes.
    accumulate_steps: micro-batches per optimiser step (stages 1/2); the updates are zero
      between optimiser steps.
    key: PRNG key for a stochastic codec; split at every update.
    gather_codec: stages 1/2: a deterministic `jaxcomm.codecs.Codec` for the parameter
      all-gather (None: the float32 updates are all-gathered). With it the state keeps the
      exact master chunk and the parameters become its decoded gather (qwZ); their error
      is the codec's (half a quantisation step per block for `codecs.uniform`).

  Returns:
    An `optax.GradientTransformationExtraArgs` (pass `params`; the Trainer does) whose
    state `ZeroState` counts the wire bytes.

  References:
    Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models, arXiv 1910.02054.

  >>> tx = zero(optax.sgd(0.1), stage=1, axis_name=None)
  >>> params = {"w": jnp.ones(3)}
  >>> state = tx.init(params)
  >>> updates, state = tx.update({"w": jnp.ones(3)}, state, params)
  >>> updates["w"]
  Array([-0.1, -0.1, -0.1], dtype=float32)
  """
  stage, axis_name, error_memory, accumulate_steps = _validate.zero_args(
      inner, stage, axis_name, codec, memory, accumulate_steps, key)
  # Extra arguments of `update` (other than params) are handed on to `inner` as they are.
  inner = optax.with_extra_args_support(inner)
  stochastic = codec is not None and codec.stochastic
  if stage == 3:
    if param_specs is None:
      raise ValueError("stage 3 needs param_specs: the PartitionSpecs the parameters are "
                       "stored with (e.g. Layout.param_specs(...)).")
    if codec is not None or accumulate_steps != 1:
      raise ValueError("stage 3 reduce-scatters inside the model's backward pass: codec and "
                       "accumulate_steps are for stages 1 and 2. For compressed ZeRO-3 across "
                       "a slow axis (ZeRO++), put stage 1 with codec and gather_codec on the "
                       "slow axis inside stage 3 on the fast one (see the module docstring).")
    if gather_codec is not None:
      raise ValueError("gather_codec is for stages 1 and 2 (stage 3 gathers inside the "
                       "model); for ZeRO++ put stage 1 with a gather_codec on the slow axis "
                       "inside stage 3 on the fast one (see the module docstring).")
    return _zero3(inner, axis_name, param_specs, regather)
  if gather_codec is not None and (not isinstance(gather_codec, codecs.Codec) or
                                   gather_codec.stochastic):
    raise ValueError(f"gather_codec must be a deterministic jaxcomm.codecs.Codec (every "
                     f"worker decodes the same parameters) or None, got {gather_codec!r}.")
  axes = comm.axis_names(axis_name)
  k = accumulate_steps
  raw_key = optax.EmptyState() if key is None else (
      jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key)

  def size():
    return comm.axis_size(axes) if axes else 1

  def my_chunk(vec, m):
    if not axes:
      return vec
    return lax.dynamic_slice_in_dim(vec, lax.axis_index(axes) * m, m)

  def init_fn(params):
    w = size()
    pvec, _ = _flat_padded(params, w)
    n, m = pvec.shape[0], pvec.shape[0] // w
    empty = optax.EmptyState()
    return ZeroState(
        inner_state=inner.init(my_chunk(pvec, m)),
        error=error_memory.init(n) if error_memory is not None else empty,
        accumulated=jnp.zeros(({1: n, 2: m}[stage],), jnp.float32) if k > 1 else empty,
        count=jnp.zeros((), jnp.int32), key=raw_key, wire_bytes=comm.zero_bytes(),
        master=my_chunk(pvec, m) if gather_codec is not None else empty)

  def scatter(vec, error, enc_key):
    """Reduce-scatter (encoded if a codec is set): (summed chunk, new error, bytes)."""
    if codec is None:
      chunk, nbytes = comm.reduce_scatter(vec, axes or None)
      return chunk, error, nbytes
    sent = vec if error_memory is None else error_memory.send(error, vec)
    if stochastic and axes and not codec.shared_key:  # Independent noise on every worker.
      enc_key = jax.random.fold_in(enc_key, lax.axis_index(axes))
    out, nbytes = comm.reduce_scatter_encoded(sent, codec, axes or None, key=enc_key)
    if error_memory is not None:
      error = error_memory.keep(error, sent, out.own)
    return out.chunk, error, nbytes

  def optimise(chunk_mean, inner_state, params, master, extra):
    """Inner step on this device's chunk, then all-gather: (vec, state, master, bytes).

    Without a gather codec the updates travel; with one, the stepped master chunk travels
    encoded and the updates move the parameters to its decoded gather.
    """
    w = size()
    pvec = p_chunk = None
    if params is not None:
      pvec, _ = _flat_padded(params, w)
      p_chunk = my_chunk(pvec, pvec.shape[0] // w)
    if gather_codec is None:
      u_chunk, inner_state = inner.update(chunk_mean, inner_state, p_chunk, **extra)
      u_vec, nbytes = comm.all_gather(u_chunk, axes or None, tiled=True)
      return u_vec, inner_state, master, nbytes
    if pvec is None:
      raise ValueError("zero with a gather_codec needs `params` in update().")
    u_chunk, inner_state = inner.update(chunk_mean, inner_state, master, **extra)
    master = optax.apply_updates(master, u_chunk)
    new_vec, nbytes = comm.all_gather_encoded(master, gather_codec, axes or None)
    return new_vec - pvec, inner_state, master, nbytes

  def update_fn(updates, state, params=None, **extra):
    comm.require_varying(updates, axes, "parallel.zero")
    w = size()
    g, unflatten = _flat_padded(updates, w)
    count = state.count + 1
    new_key, enc_key = (jax.random.split(state.key) if stochastic else (state.key, None))
    if k == 1:
      chunk, error, nb1 = scatter(g, state.error, enc_key)
      u_vec, inner_state, master, nb2 = optimise(chunk / w, state.inner_state, params,
                                                 state.master, extra)
      return unflatten(u_vec), ZeroState(inner_state, error, state.accumulated, count,
                                         new_key, comm.add_bytes(state.wire_bytes, nb1 + nb2),
                                         master)
    counter = state.wire_bytes
    if stage == 1:  # Sum the whole local gradient; reduce-scatter once per optimiser step.
      pending, error = state.accumulated + g, state.error
    else:  # Reduce-scatter every micro-batch; keep only the owned chunk.
      chunk, error, nb1 = scatter(g, state.error, enc_key)
      pending, counter = state.accumulated + chunk, comm.add_bytes(counter, nb1)

    def step(op):
      pending, error, inner_state, counter, master = op
      chunk, nb1 = pending, 0.0
      if stage == 1:
        chunk, error, nb1 = scatter(pending, error, enc_key)
      u_vec, inner_state, master, nb2 = optimise(chunk / (w * k), inner_state, params, master,
                                                 extra)
      return (u_vec, jnp.zeros_like(pending), error, inner_state,
              comm.add_bytes(counter, nb1 + nb2), master)

    def wait(op):
      pending, error, inner_state, counter, master = op
      # Fresh zeros (not zeros_like the local gradient, which would vary per worker).
      return jnp.zeros(g.shape, g.dtype), pending, error, inner_state, counter, master

    u_vec, pending, error, inner_state, counter, master = comm.cond(
        count % k == 0, step, wait, (pending, error, state.inner_state, counter, state.master))
    return unflatten(u_vec), ZeroState(inner_state, error, pending, count, new_key, counter,
                                       master)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _zero3(inner, axis_name, param_specs, regather):
  axes = comm.axis_names(axis_name)
  spec_leaves = jax.tree.leaves(v.specs("param_specs", param_specs),
                                is_leaf=lambda s: isinstance(s, P))
  dims = [gather_dims(s, axes) for s in spec_leaves]
  regathered = [True] * len(dims) if regather is None else jax.tree.leaves(regather)
  if len(regathered) != len(dims) or not all(isinstance(r, bool) for r in regathered):
    raise ValueError(f"regather must be a tree of bools like param_specs ({len(dims)} "
                     f"leaves), got {regather!r}.")

  def init_fn(params):
    empty = optax.EmptyState()
    return ZeroState(inner_state=inner.init(params), error=empty, accumulated=empty,
                     count=jnp.zeros((), jnp.int32), key=empty, wire_bytes=comm.zero_bytes())

  def finish_mean(g, pairs, again):
    """(mean over `axes` of one gradient leaf, bytes the model and this step sent for it)."""
    gathered = tuple(a for _, ax in pairs for a in ax)
    rest = tuple(a for a in axes if a not in gathered)
    nbytes, local = 0.0, comm.tree_bytes(g)
    for _, ax in pairs:  # Forward gather, backward re-gather and reduce-scatter, per dim.
      w = comm.axis_size(ax)
      nbytes += ((1 + again) * comm.all_gather_bytes(local, w) +
                 comm.reduce_scatter_bytes(local * w, w))
      local *= w
    if gathered:
      g = g / comm.axis_size(gathered)
    g, nb = comm.mean(g, rest or None)
    return g, nbytes + nb

  def update_fn(updates, state, params=None, **extra):
    comm.require_varying(updates, axes, "parallel.zero")
    leaves, treedef = jax.tree.flatten(updates)
    if len(leaves) != len(dims):
      raise ValueError(f"zero(stage=3): {len(leaves)} gradient leaves but {len(dims)} "
                       "param_specs.")
    means, nbytes = [], 0.0
    if axes:
      for g, pairs, again in zip(leaves, dims, regathered):
        g, nb = finish_mean(g, pairs, again)
        means.append(g)
        nbytes += nb
    else:
      means = leaves
    updates, inner_state = inner.update(jax.tree.unflatten(treedef, means), state.inner_state,
                                        params, **extra)
    return updates, state._replace(inner_state=inner_state, count=state.count + 1,
                                   wire_bytes=comm.add_bytes(state.wire_bytes, nbytes))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
