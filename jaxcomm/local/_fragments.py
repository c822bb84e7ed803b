"""What Streaming DiLoCo and CoCoDC share: the state, fragments, sends, outer steps, merges.

Both are `local.periodic` schedules with one slot per fragment: the fragment's send and
outer step in `sync_fn`, its merge `overlap` updates later in `after_fn`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs
from jaxcomm.local import _core
from jaxcomm.local import _diloco
from jaxcomm.local import _periodic
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
  # Eager updates only (None otherwise): in_flight as above; outer_params and outer_state
  # are then per-worker.
  sent: Any = None         # f32[P, m]: row p, this worker's share of in_flight[p] (per-worker)


def default_codec() -> codecs.Codec:
  """The paper's outer-gradient codec: 4-bit floats (E2M1, `codecs.fp4()`)."""
  return codecs.fp4()


def _deal(vec: jax.Array, num: int) -> jax.Array:
  """f32[n] -> f32[P, m]: element i goes to fragment i mod P (zero-padded)."""
  vec = jnp.pad(vec, (0, (-vec.shape[0]) % num))
  return vec.reshape(-1, num).T


def _undeal(mat: jax.Array, n: int) -> jax.Array:
  return mat.T.reshape(-1)[:n]


class Fragments:
  """What Streaming DiLoCo and CoCoDC share: checked arguments, fragment sends and merges."""

  def __init__(self, name, inner, outer, sync_every, fragments, overlap, alpha, axis_name,
               codec, collective, participation, key):
    self.name = name
    self.inner, self.sync_every, self.axis_name, self.live_fn = _core.schedule_args(
        inner, sync_every, axis_name, participation)
    self.outer = v.transform("outer", outer)
    # At most one fragment syncs per step (sync_every = H is the upper bound).
    self.fragments = v.integer("fragments", fragments, low=1, high=self.sync_every)
    self.overlap = v.integer("overlap", overlap, low=0, high=self.sync_every - 1)
    self.alpha = v.number("alpha", alpha, low=0.0, high=1.0)
    if isinstance(codec, str):
      if codec != "auto":
        raise ValueError(f"codec must be 'auto', a jaxcomm.codecs.Codec (or a factory of one) "
                         f"or None, got {codec!r}.")
      codec = default_codec()
    self.codec = _transport.check_codec(codec)
    self.collective = _transport.check_collective(collective, self.codec)
    self.key = v.key("key", key)
    self.offsets = [p * self.sync_every // self.fragments for p in range(self.fragments)]
    self.phases = _core.Phases(self.sync_every, self.offsets)

  def init_fields(self, params) -> dict:
    """The outer parameters dealt into fragments and one outer state per fragment."""
    leaves = jax.tree.leaves(params)
    if self.fragments > len(leaves):
      raise ValueError(f"fragments ({self.fragments}) must be <= the number of parameter "
                       f"leaves ({len(leaves)}).")
    outer_params = _deal(codecs.flatten(params)[0], self.fragments)
    if self.codec is not None:  # a fragment travels as one flat vector: a factory sees [(m,)]
      codecs.for_tree(self.codec, outer_params[0])
    return dict(outer_params=outer_params, outer_state=jax.vmap(self.outer.init)(outer_params))

  def send(self, sync, local, outer_params):
    """All-reduces fragment p = sync.slot's outer gradient: (p, Δ_p, θ_w,p, wire bytes)."""
    p = sync.slot
    frag_local = _deal(codecs.flatten(local)[0], self.fragments)[p]
    grad, _, nbytes = _diloco.outer_gradient(outer_params[p], frag_local, sync.mine,
                                             sync.weights, sync.total, None, sync.key,
                                             self.codec, self.axis_name,
                                             collective=self.collective)
    return p, grad, frag_local, nbytes

  def outer_step(self, p, grad, outer_params, outer_state):
    """Steps fragment p's outer parameters with the outer gradient `grad`."""
    frag_state = jax.tree.map(lambda x: x[p], outer_state)
    step, frag_state = self.outer.update(grad, frag_state, outer_params[p])
    outer_params = outer_params.at[p].set(optax.apply_updates(outer_params[p], step))
    outer_state = jax.tree.map(lambda x, y: x.at[p].set(y), outer_state, frag_state)
    return outer_params, outer_state

  def merge(self, t, local, target_fn):
    """Mixes fragment q, synced `overlap` updates ago, into the worker's parameters.

    `target_fn(q, mine, θ_w,q)` gives the fragment's synchronised value.
    """
    q = self.phases.slot(t - self.overlap)
    mine, _, _ = _core.live_weights(self.live_fn, self.phases.sync_index(t - self.overlap),
                                    self.axis_name)
    vec, unflatten = codecs.flatten(local)
    mat = _deal(vec, self.fragments)
    a = jnp.where(mine > 0, self.alpha, 0.0)
    mat = mat.at[q].set(a * mat[q] + (1.0 - a) * target_fn(q, mine, mat[q]))
    return unflatten(_undeal(mat, vec.shape[0]))

  def merging(self, t):
    """bool[]: a fragment is merged at update t."""
    return self.phases.slot(t - self.overlap) >= 0

  def transform(self, sync_fn, after_fn, **extra_fn) -> optax.GradientTransformationExtraArgs:
    """`local.periodic` with a slot per fragment, `sync_fn` at its sync, `after_fn` after.

    `extra_fn`: state fields of `StreamingDilocoState` beyond the outer parameters and
    state, each `fn(outer_params f32[P, m])` of its initial value.
    """

    def init_fn(params):
      fields = self.init_fields(params)
      return {**fields, **{k: fn(fields["outer_params"]) for k, fn in extra_fn.items()}}

    return _periodic.periodic(self.inner, self.sync_every, sync_fn, init_fn=init_fn,
                              state_type=StreamingDilocoState, axis_name=self.axis_name,
                              participation=self.live_fn, offsets=self.offsets,
                              key=self.key, after_fn=after_fn, name=self.name)
