"""Gradient coding for stragglers: fractional-repetition codes (Tandon et al.).

The global batch is split into n partitions. Workers form n / (s + 1) groups of s + 1; every
worker of group g holds the same s + 1 partitions (placed redundantly, like any data
loading: `FractionalRepetition.place`) and sends the gradient of their mean. Any s
stragglers leave at least one worker in every group, so the master recovers the full
gradient exactly from the first survivor of each group. Straggler patterns are drawn per step
from a key kept in the state.

In SPMD every device takes part in the reduction, so the master's "receive from the
survivors" is a sum in which stragglers carry weight 0 (the decoding vector). With no codec
the weighted gradients are all-reduced; with a codec (the approximate, quantised variant)
each worker's coded gradient travels encoded by all-gather and the survivors' payloads are
decoded and summed in float32. With more stragglers than the code tolerates
(`approximate=True`), groups without a survivor are lost and the recovered ones are rescaled
by groups / recovered groups, an unbiased estimate when patterns are uniform
*(the exact estimator of arXiv 2605.15890 is unverified; this is the standard one)*.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import codecs
from jaxcomm import comm


@dataclasses.dataclass(frozen=True)
class FractionalRepetition:
  """A fractional-repetition code for `num_workers` workers tolerating `stragglers`."""
  num_workers: int
  stragglers: int

  @property
  def group_size(self) -> int:
    return self.stragglers + 1

  @property
  def num_groups(self) -> int:
    return self.num_workers // self.group_size

  def partitions(self, worker: int) -> list[int]:
    """The data partitions `worker` computes: its group's s + 1 partitions."""
    g = worker // self.group_size
    return list(range(g * self.group_size, (g + 1) * self.group_size))

  def assignment(self) -> np.ndarray:
    """B[i, p] = 1 when worker i computes partition p (i32[n, n])."""
    b = np.zeros((self.num_workers, self.num_workers), np.int32)
    for i in range(self.num_workers):
      b[i, self.partitions(i)] = 1
    return b

  def place(self, batch: Any) -> Any:
    """Redundant data placement: worker i's block is its group's partitions of `batch`.

    Every leaf's leading dimension N (divisible by n) is split into n partitions; the result
    has (s + 1) N rows, worker-major, so sharding it over the data axis gives each worker its
    s + 1 partitions.
    """
    def leaf(x):
      x = np.asarray(x)
      if x.shape[0] % self.num_workers:
        raise ValueError(f"batch leading dimension {x.shape[0]} must be divisible by "
                         f"num_workers={self.num_workers}.")
      parts = x.reshape(self.num_workers, -1, *x.shape[1:])
      return np.concatenate([parts[self.partitions(i)].reshape(-1, *x.shape[1:])
                             for i in range(self.num_workers)])
    return jax.tree.map(leaf, batch)

  def decoding_weights(self, stragglers: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(a f32[n], recovered groups f32[]): a is 1 on the first survivor of each group.

    `stragglers` is bool[n]. sum_i a_i c_i, with c_i worker i's coded gradient, is the sum
    over recovered groups of their partitions' mean gradient.
    """
    alive = ~stragglers.reshape(self.num_groups, self.group_size)
    first = jnp.argmax(alive, axis=1)
    has = jnp.any(alive, axis=1)
    a = jax.nn.one_hot(first, self.group_size) * has[:, None]
    return a.reshape(-1).astype(jnp.float32), has.sum().astype(jnp.float32)


def fractional_repetition(num_workers: int, stragglers: int) -> FractionalRepetition:
  """Builds a fractional-repetition code: n workers, any s stragglers, (s + 1) | n.

  Args:
    num_workers: n, the size of the data axis.
    stragglers: s, how many workers may not answer (0 <= s < n).

  Returns:
    A `FractionalRepetition` code.

  References:
    Tandon, Lei, Dimakis, Karampatziakis, Gradient coding, arXiv 1612.03301.

  >>> code = fractional_repetition(8, 1)
  >>> code.num_groups, code.partitions(5)
  (4, [4, 5])
  """
  num_workers = v.integer("num_workers", num_workers, low=1)
  stragglers = v.integer("stragglers", stragglers)
  if not 0 <= stragglers < num_workers:
    raise ValueError(f"stragglers must be in [0, num_workers - 1] = [0, {num_workers - 1}], "
                     f"got s={stragglers}.")
  if num_workers % (stragglers + 1):
    raise ValueError(f"fractional repetition needs (stragglers + 1) to divide num_workers; "
                     f"s + 1 = {stragglers + 1} does not divide n = {num_workers}.")
  return FractionalRepetition(int(num_workers), int(stragglers))


def decode_gradient(coded: Any, code: FractionalRepetition, stragglers: jax.Array,
                    axis_name: comm.AxisName, *, approximate: bool = False,
                    codec: codecs.CodecLike | None = None, key: jax.Array | None = None,
                    ) -> tuple[Any, float, jax.Array]:
  """The full-batch mean gradient from the workers' coded gradients, ignoring stragglers.

  Called inside `shard_map`: `coded` is this worker's gradient of the mean loss over its
  s + 1 partitions, `stragglers` bool[n] the same pattern on every worker.

  Returns:
    `(mean gradient over all partitions, wire bytes, recovered groups f32[])`. With
    `approximate`, lost groups are made up for by rescaling the recovered ones.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> code = fractional_repetition(8, 1)
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> late = jnp.zeros(8, bool).at[3].set(True)  # worker 3 straggles
    >>> f = jax.shard_map(lambda g: decode_gradient(g, code, late, "data")[0], mesh=mesh,
    ...                   in_specs=jax.P("data"), out_specs=jax.P())
    >>> f(jnp.ones(8)).tolist()  # every worker sent gradient 1: the mean is still 1
    [1.0]
  """
  axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name or ())
  comm.require_varying(coded, axes, "sync.decode_gradient")
  if not axes and code.num_workers == 1:  # One worker: nothing straggles, nothing travels.
    return coded, 0.0, jnp.ones((), jnp.float32)
  if comm.axis_size(axes) != code.num_workers:
    raise ValueError(f"the code has {code.num_workers} workers but the mesh axis {axes} has "
                     f"{comm.axis_size(axes)}.")
  a, recovered = code.decoding_weights(stragglers)
  me = lax.axis_index(axes)
  # Each recovered group contributes the mean of its s + 1 partitions' gradients.
  scale = code.group_size / code.num_workers
  if approximate:
    scale = scale * code.num_groups / jnp.maximum(recovered, 1.0)
  if codec is None:
    total, nbytes = comm.sum(jax.tree.map(lambda g: a[me].astype(g.dtype) * g, coded), axes)
    return jax.tree.map(lambda g: (scale * g).astype(g.dtype), total), nbytes, recovered
  codec = codecs.for_tree(codec, coded)
  flat, unflatten = codecs.flatten(coded)
  payload = tuple(codec.encode(flat, key))
  gathered, nbytes = comm.all_gather(tuple(comm.to_bits(p) for p in payload), axes)
  decoded = jax.vmap(lambda *p: codec.decode(
      tuple(comm.from_bits(x, q.dtype) for x, q in zip(p, payload)), flat.shape[0]))(*gathered)
  return unflatten(scale * jnp.tensordot(a, decoded, axes=1)), nbytes, recovered


class GradientCodingState(NamedTuple):
  """State of `gradient_coding`."""
  key: jax.Array         # u32[2]: draws the straggler pattern of each step (shared)
  stragglers: jax.Array  # bool[n]: the pattern of the last step
  recovered: jax.Array   # f32[]: groups recovered in the last step
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)


def gradient_coding(code: FractionalRepetition, *, axis_name: comm.AxisName = "data",
                    num_stragglers: int | None = None, approximate: bool = False,
                    codec: codecs.CodecLike | None = None,
                    key: jax.Array | None = None) -> optax.GradientTransformation:
  """Replaces each worker's coded gradient by the decoded full-batch mean gradient.

  Feed the Trainer batches placed with `code.place(batch)`; each step draws a uniformly
  random set of `num_stragglers` workers whose gradients are ignored.

  Args:
    code: a `fractional_repetition` code.
    axis_name: the data axis (its size must be the code's `num_workers`).
    num_stragglers: stragglers drawn per step (default: the code's s). More than s needs
      `approximate=True`.
    approximate: rescale recovered groups when some group has no survivor.
    codec: send coded gradients quantised with this codec (by all-gather), or with the
      codec a factory `shapes -> Codec` makes for the gradient's leaf shapes; None sends
      them exactly (all-reduce of the weighted gradients).
    key: PRNG key of the straggler patterns (and of a stochastic codec); None is the fixed
      default `jax.random.key(0)`.

  Returns:
    An `optax.GradientTransformation` (chain it before the optimiser, like `sync.mean`).

  References:
    Tandon et al., Gradient coding, arXiv 1612.03301; approximate and quantised gradient
    coding, arXiv 2605.15890.

  >>> tx = gradient_coding(fractional_repetition(8, 1))
  >>> int(tx.init({"w": jnp.zeros(2)}).stragglers.sum())
  0
  """
  v.instance("code", code, FractionalRepetition,
             "FractionalRepetition (from sync.fractional_repetition)")
  count = code.stragglers if num_stragglers is None else v.integer(
      "num_stragglers", num_stragglers, low=0, high=code.num_workers - 1)
  if count > code.stragglers and not approximate:
    raise ValueError(f"num_stragglers={count} exceeds the code's s={code.stragglers}: exact "
                     "decoding is impossible; pass approximate=True.")
  codecs.validate(codec, allow_none=True)
  n = code.num_workers
  key = v.key("key", key)

  def init_fn(params):
    if codec is not None:
      codecs.for_tree(codec, params)  # a bad codec or factory fails here, before any step
    return GradientCodingState(key=key, stragglers=jnp.zeros((n,), bool),
                               recovered=jnp.asarray(code.num_groups, jnp.float32),
                               wire_bytes=comm.zero_bytes())

  def update_fn(updates, state, params=None):
    comm.require_varying(updates, axis_name, "sync.gradient_coding")
    del params
    key, pattern_key, codec_key = jax.random.split(state.key, 3)
    stragglers = jnp.zeros((n,), bool).at[jax.random.permutation(pattern_key, n)[:count]].set(True)
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name or ())
    worker_key = jax.random.fold_in(codec_key, lax.axis_index(axes)) if axes else codec_key
    grads, nbytes, recovered = decode_gradient(updates, code, stragglers, axis_name,
                                               approximate=approximate, codec=codec,
                                               key=worker_key)
    return grads, GradientCodingState(key=key, stragglers=stragglers, recovered=recovered,
                                      wire_bytes=comm.add_bytes(state.wire_bytes, nbytes))

  return optax.GradientTransformation(init_fn, update_fn)
