"""Compressed gradient synchronisation: codec x collective, with an error memory plugged in
(`sync.ErrorMemory`, in _memory.py)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm
from jaxcomm.sync import _memory


class CompressedState(NamedTuple):
  """State of `compressed`; absent buffers are None."""
  memory: Any                      # per worker: the ErrorMemory's buffers, [n] each (ef, loco:
                                   # e_w; ef21: h_w), None without a memory
  aggregate: jax.Array | None      # f32[n], accumulating memories (ef21) only: h = mean_w h_w
                                   # (the same on all workers)
  server_memory: jax.Array | None  # f32[n], per worker: two-phase owner-side error (own chunk)
  key: jax.Array | None            # u32[2]: PRNG key data, split every update (stochastic codecs)
  wire_bytes: jax.Array            # u32[]: cumulative bytes sent by this device (mod 2**32)


def _payload_has_narrow_floats(codec: codecs.Codec) -> bool:
  """Whether some payload leaf is a float narrower than float32 (read from shapes only)."""
  try:
    out = codecs.payload_spec(codec, codec.length or 4096)
  except ValueError as e:
    if isinstance(e.__cause__, TypeError):  # a codec that uses its key without saying so
      raise
    return False  # e.g. a fixed k larger than the probe; such codecs send float32 values
  return any(jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4
             for x in jax.tree.leaves(out))


def _choose_collective(codec: codecs.Codec, collective: str | None, key: Any) -> str:
  """The collective for `codec` (None: choose), checked against the codec's flags."""
  narrow = _payload_has_narrow_floats(codec)
  whole = not codecs.splittable(codec)
  if collective is None:
    if codec.linear and not narrow:
      collective = "psum"
    elif whole:  # two_phase would split the vector; gather sends it whole
      collective = "gather"
    else:
      collective = "two_phase" if codec.linear else codec.collective
  if collective == "psum" and not codec.linear:
    raise ValueError(f"collective='psum' sums payloads as codes, but codec {codec.name} is not "
                     f"linear; use collective='gather' or 'two_phase'.")
  if collective == "psum" and narrow:
    raise ValueError(f"collective='psum' would psum {codec.name}'s narrow-float payload, which "
                     f"XLA:CPU widens to float32 on the wire; use collective='two_phase'.")
  if collective == "two_phase" and whole:
    raise ValueError(f"collective='two_phase' encodes 1/W chunks of the vector, but codec "
                     f"{codec.name} needs the whole vector (it is built for one length or for "
                     f"the parameters' shapes); use collective='gather' or None.")
  if codec.stochastic and key is None:
    raise ValueError(f"codec {codec.name} is stochastic: pass key=jax.random.key(seed).")
  return collective


def _key_data(key):
  """Raw uint32 key data (checkpointable) and the key's implementation (None: default)."""
  key = key if isinstance(key, jax.Array) else jnp.asarray(key)
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key), jax.random.key_impl(key)
  return key.astype(jnp.uint32), None


def _split_axes(axis_name) -> tuple[tuple, tuple]:
  """(fast axes reduced exactly, slow axes compressed)."""
  axes = comm.axis_names(axis_name)
  return (axes[:1], axes[1:]) if len(axes) > 1 else ((), axes)


class _FastShard:
  """The exact fast-axis part of a hierarchical reduction: this device's slots of the vector.

  The flat vector (n slots, zero-padded to F * m) is reduce-scattered over the fast axes; the
  device then compresses its m slots over the slow axes, and the results are all-gathered.
  Buffers keep the full length n (state shapes must not depend on the mesh); a device reads
  and writes only its own slots. Without fast axes every method is the identity.
  """

  def __init__(self, n: int, fast: tuple, f_size: int = 1):
    self.n, self.fast, self.f_size = n, fast, f_size
    self.m = -(-n // f_size)
    self.start = lax.axis_index(fast) * self.m if fast else 0

  @classmethod
  def create(cls, n: int, fast: tuple) -> "_FastShard":
    return cls(n, fast, comm.axis_size(fast) if fast else 1)

  def _pad(self, buf):
    return jnp.pad(buf, (0, self.f_size * self.m - self.n))

  def reduce(self, g):
    """This device's slots of the mean over the fast axes, and the wire bytes."""
    if not self.fast:
      return g, 0.0
    shard, nbytes = comm.reduce_scatter(self._pad(g), self.fast)
    return shard / self.f_size, nbytes

  def region(self, buf):
    return lax.dynamic_slice(self._pad(buf), (self.start,), (self.m,)) if self.fast else buf

  def write(self, buf, slots):
    if not self.fast:
      return slots.astype(buf.dtype)
    return lax.dynamic_update_slice(self._pad(buf), slots.astype(buf.dtype),
                                    (self.start,))[:self.n]

  def gather(self, slots):
    """The full vector from every device's slots, and the wire bytes."""
    if not self.fast:
      return slots, 0.0
    full, nbytes = comm.all_gather(slots, self.fast, tiled=True)
    return full[:self.n], nbytes


def _error_memory(memory, beta, memory_dtype) -> _memory.ErrorMemory | None:
  """The `ErrorMemory` of compressed's `memory` argument (a name is built with `beta` and
  `memory_dtype`, checked under those names)."""
  beta = v.number("beta", beta, low=0.0, high=1.0, high_open=True)
  if memory_dtype is not None:
    memory_dtype = v.dtype("memory_dtype", memory_dtype)
  if isinstance(memory, _memory.ErrorMemory) and memory_dtype is not None:
    raise ValueError("memory_dtype sets a named memory's dtype; an ErrorMemory carries its "
                     "own (e.g. sync.error_feedback(dtype)).")
  return _memory.resolve_memory(memory, beta=beta, dtype=memory_dtype, stage="sync.compressed")


def compressed(codec: codecs.CodecLike, memory: str | _memory.ErrorMemory | None = None,
               collective: str | None = None, axis_name: comm.AxisName = "data", *, key: Any = None,
               server_memory: bool | None = None, beta: float = 0.9,
               memory_dtype: Any = None) -> optax.GradientTransformation:
  """Replaces each worker's gradient by the mean over workers of what `codec` lets travel.

  The gradient tree is flattened into one float32 vector (one encode, one collective per
  step). Per step, worker w with local gradient g_w:

  * memory=None: send C(g_w).
  * an error memory (`sync.ErrorMemory`): send C(p) with p = memory.send(m_w, g_w), then
    m_w <- memory.keep(m_w, p, D(C(p))). The named ones: "ef" (`sync.error_feedback`:
    p = g_w + e_w; e_w <- p - D(C(p))), "ef21" (`sync.ef21`: p = g_w - h_w;
    h_w <- h_w + D(C(p)); the update is h <- h + mean_w D(C(p_w)), not this step's mean) and
    "loco" (`sync.loco`: p = g_w + e_w; e_w <- beta e_w + (1 - beta)(p - D(C(p))), kept in
    `memory_dtype`, bfloat16 by default). A memory of your own is an `ErrorMemory` too.

  `collective` is how the payloads are summed (see `jaxcomm.comm.compressed_sum`): "psum"
  (only linear codecs with float32 payloads), "gather" (all-gather, decode each, sum in
  float32) or "two_phase" (all-to-all of encoded chunks, float32 reduction on the owner,
  re-encode with an owner-side error memory, all-gather; the codec then sees W chunks of
  ceil(n / W) elements, so a fixed count such as top_k(k=...) applies per chunk). None
  picks: psum for linear float32 codecs, two_phase for linear narrow floats (cast to bf16),
  else the codec's preference (gather for sparsifiers, two_phase for quantisers).

  Hierarchical reduction: with a tuple `axis_name=(fast, slow, ...)` the FIRST axis is the
  fast one (devices inside a node): gradients are reduce-scattered over it exactly in
  float32, each device compresses its 1/F shard over the remaining (slow) axes, and the
  results are all-gathered over the fast axis. Memories of a shard live in its slots of the
  full-length buffers (state shapes never depend on the mesh).

  Sharded gradients (a replica of a model laid out over fsdp / tensor, see
  `parallel.Layout.optimizer`): the codec acts per shard, on the flat vector of this
  device's shards, and the memories hold this device's shards (their memory falls with the
  shard count). A block codec then equals its unsharded self when its block divides every
  shard's last dimension (the blocks hold the same elements); a top-k keeps k per shard.

  Randomness: stochastic codecs need `key`; it lives in the state and is split every update.
  Each worker folds in its axis index, except for shared-key codecs (random-k with a shared
  key), where every worker must draw the same coordinates.

  Args:
    codec: a `jaxcomm.codecs.Codec`, or a factory `shapes -> Codec` called with the
      parameters' leaf shapes (a per-tensor codec, see `jaxcomm.codecs.for_tree`). Codecs
      that need the whole vector (a factory's, or one with a `length`) refuse
      collective='two_phase' and hierarchical axes.
    memory: None, an `ErrorMemory`, or the name of one: "ef", "ef21" or "loco".
    collective: None (choose), "psum", "gather" or "two_phase".
    axis_name: the data axis, a (fast, slow) tuple, or None for one device.
    key: PRNG key (required for stochastic codecs).
    server_memory: two-phase owner-side error memory; default: on when `memory` is set.
    beta: LoCo's moving-average factor in [0, 1) (memory="loco").
    memory_dtype: dtype of a named memory's buffers (default float32; bfloat16 for loco); an
      `ErrorMemory` object carries its own.

  Returns:
    An `optax.GradientTransformation` whose state keeps the memories, the key and the wire
    bytes; error memories differ per worker (the Trainer stores them per worker).

  References:
    Seide et al. 2014; Karimireddy et al., arXiv 1901.09847 (EF); Richtarik et al., arXiv
    2106.05203 (EF21); Xie et al., arXiv 2407.04480 (LoCo); Stich et al., arXiv 1809.07599.

  >>> import jax.numpy as jnp, optax
  >>> from jaxcomm import codecs
  >>> tx = compressed(codecs.top_k(k=1), memory="ef", axis_name=None)
  >>> state = tx.init({"w": jnp.zeros(3)})
  >>> updates, state = tx.update({"w": jnp.array([1., -3., 2.])}, state)
  >>> updates["w"], state.memory
  (Array([ 0., -3.,  0.], dtype=float32), Array([1., 0., 2.], dtype=float32))
  """
  codecs.validate(codec)
  memory = _error_memory(memory, beta, memory_dtype)
  if collective is not None and collective not in comm.COLLECTIVES:
    raise ValueError(f"collective must be None or one of {comm.COLLECTIVES}, got {collective!r}.")
  fast, slow = _split_axes(axis_name)
  if fast and not codecs.splittable(codec):
    raise ValueError(f"axis_name={axis_name!r} is hierarchical: the fast axis {fast[0]!r} "
                     f"reduce-scatters the vector and each device compresses its 1/F shard, but "
                     f"codec {getattr(codec, 'name', codec)!r} needs the whole vector (it is "
                     f"built for one length or for the parameters' shapes); use one axis.")
  if isinstance(codec, codecs.Codec):  # Everything is known now; a factory waits for shapes.
    collective = _choose_collective(codec, collective, key)
  elif collective == "two_phase":
    raise ValueError(f"collective='two_phase' encodes 1/W chunks of the vector, but a codec made "
                     f"by a factory ({codec!r}) is built for the parameters' shapes and needs the "
                     f"whole vector; use collective='gather' or None.")
  if server_memory is None:
    server_memory = memory is not None and collective == "two_phase"
  if server_memory and collective != "two_phase":
    raise ValueError(f"server_memory=True needs collective='two_phase', got {collective!r}.")
  key_data, key_impl = _key_data(key) if key is not None else (None, None)

  def resolve(tree):
    """(the codec for `tree`'s flat vector, its collective): a factory is called here."""
    c = codecs.for_tree(codec, tree)
    return c, (collective if c is codec else _choose_collective(c, collective, key))

  def init_fn(params):
    c, _ = resolve(params)
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    zeros = jnp.zeros((n,), jnp.float32)
    return CompressedState(
        memory=memory.init(n) if memory else None,
        aggregate=zeros if memory and memory.accumulate else None,
        server_memory=zeros if server_memory else None,
        key=key_data if c.stochastic else None, wire_bytes=comm.zero_bytes())

  def step_key(state, c):
    if state.key is None:
      return None, None
    k, sub = jax.random.split(jax.random.wrap_key_data(state.key, impl=key_impl))
    if not c.shared_key and (fast or slow):
      sub = jax.random.fold_in(sub, lax.axis_index(fast + slow))
    return jax.random.key_data(k), sub

  def update_fn(updates, state, params=None):
    comm.require_varying(updates, axis_name, "sync.compressed")
    del params
    c, how = resolve(updates)
    g, unflatten = codecs.flatten(updates)
    new_key, sub = step_key(state, c)
    shard = _FastShard.create(g.shape[0], fast)
    x, fast_bytes = shard.reduce(g)  # g itself without fast axes
    mem = None if memory is None else jax.tree.map(
        lambda b: shard.region(b).astype(jnp.float32), state.memory)
    sent = x if memory is None else memory.send(mem, x)
    server = None if state.server_memory is None else shard.region(state.server_memory)
    out, nbytes = comm.compressed_sum(sent, c, slow or None, how, key=sub,
                                      server_memory=server)
    delta, gather_bytes = shard.gather(out.total / comm.axis_size(slow))
    new_memory, aggregate = state.memory, state.aggregate
    if memory is not None:
      new_memory = jax.tree.map(shard.write, state.memory, memory.keep(mem, sent, out.own))
      if memory.accumulate:
        aggregate = delta = state.aggregate + delta
    if server is not None:
      server = shard.write(state.server_memory, out.server_memory)
    new_state = CompressedState(
        memory=new_memory, aggregate=aggregate, server_memory=server, key=new_key,
        wire_bytes=comm.add_bytes(state.wire_bytes, nbytes + fast_bytes + gather_bytes))
    return unflatten(delta), new_state

  return optax.GradientTransformation(init_fn, update_fn)
