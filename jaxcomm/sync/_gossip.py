"""Decentralised training by gossip: D-PSGD and CHOCO-SGD over a `GossipGraph`.

There is no all-reduce: each worker keeps its own parameters and, every step, averages them
with its graph neighbours' through one `ppermute` per neighbour. Under the `Trainer` the
parameters therefore become per-worker (stored with a leading worker axis); the transforms
return updates that turn each worker's parameters into its gossip result.

Consensus distance, sqrt(mean_w ||x_w - mean(x)||^2), needs every worker's parameters, so it
cannot come for free inside a step. `measure_consensus=True` computes it exactly after every
step with one extra all-reduce of the parameters and one of a scalar, and counts those bytes
with the gossip bytes (turn it off when comparing wire bytes). `stacked_consensus_distance`
computes it from the Trainer's per-worker params outside the step (no collective in the step).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import codecs
from jaxcomm import comm
from jaxcomm.sync._topology import GRAPHS, GossipGraph, gossip_graph


def _check_axis(graph: GossipGraph, axes: tuple) -> None:
  size = comm.axis_size(axes)
  if size != graph.num_workers:
    raise ValueError(f"gossip graph {graph.name!r} has {graph.num_workers} workers but the "
                     f"mesh axis {axes} has {size}: build it with num_workers={size}.")


def _weight(w: np.ndarray, index: jax.Array, dtype) -> Any:
  """This worker's weight: a constant when all workers share it, else a table lookup."""
  if np.allclose(w, w[0], rtol=0, atol=0):
    return jnp.asarray(w[0], dtype)
  return jnp.asarray(w, dtype)[index]


def _perm(src: np.ndarray) -> list:
  return [(int(s), i) for i, s in enumerate(src)]


def _mix_phase(tree: Any, graph: GossipGraph, axes: tuple, phase: int) -> tuple[Any, float]:
  """sum_j M[i, j] x_j for one static phase: one ppermute per neighbour."""
  self_w, neigh_w = graph.weights(phase)
  index = lax.axis_index(axes)
  out = jax.tree.map(lambda x: _weight(self_w, index, x.dtype) * x, tree)
  nbytes = 0.0
  for src, w in zip(graph.sources[phase], neigh_w):
    received, sent = comm.ppermute(tree, axes, _perm(src))
    out = jax.tree.map(lambda o, r, w=w: o + _weight(w, index, r.dtype) * r, out, received)
    nbytes += sent
  return out, nbytes


def gossip(tree: Any, graph: GossipGraph, axis_name: comm.AxisName,
           phase: int | jax.Array = 0) -> tuple[Any, float]:
  """One gossip round: worker i gets sum_j M[i, j] x_j, with M the graph's mixing matrix.

  Called inside `shard_map`. Every neighbour costs one `ppermute` of the whole tree.

  Args:
    tree: this worker's values (any pytree of float arrays).
    graph: the `GossipGraph`; its `num_workers` must equal the size of `axis_name`.
    axis_name: the mesh axis (or axes) the workers lie on; None means one worker (identity).
    phase: which phase of a time-varying graph to use (an int or a traced int32[]; taken
      mod the period).

  Returns:
    `(mixed tree, wire bytes)`: bytes = degree * tree bytes (docs/algorithms.md, point-to-point).

  >>> out, nbytes = gossip({"w": jnp.ones(3)}, gossip_graph("ring", 8), None)
  >>> out["w"], nbytes
  (Array([1., 1., 1.], dtype=float32), 0.0)
  """
  axes = comm.axis_names(axis_name)
  if not axes:
    return tree, 0.0
  _check_axis(graph, axes)
  if graph.period == 1 or isinstance(phase, (int, np.integer)):
    return _mix_phase(tree, graph, axes, int(phase) % graph.period)
  per_phase = {graph.degree(p) for p in range(graph.period)}
  if len(per_phase) != 1:
    raise ValueError(f"graph {graph.name!r} sends different bytes per phase; pass a static "
                     "phase or use the dpsgd transform, which counts each phase's bytes.")
  branches = [lambda t, p=p: _mix_phase(t, graph, axes, p)[0] for p in range(graph.period)]
  mixed = lax.switch(phase % graph.period, branches, tree)
  return mixed, graph.degree(0) * float(comm.tree_bytes(tree))


def _mix_counted(tree, graph, axes, phase, counter):
  """Gossip that adds its bytes to `counter` inside the branch that sends."""
  if not axes:
    return tree, counter

  def branch(p):
    def run(t, c):
      mixed, nbytes = _mix_phase(t, graph, axes, p)
      return mixed, comm.add_bytes(c, nbytes)
    return run

  _check_axis(graph, axes)
  if graph.period == 1:
    return branch(0)(tree, counter)
  return lax.switch(phase % graph.period, [branch(p) for p in range(graph.period)],
                    tree, counter)


def consensus_distance(tree: Any, axis_name: comm.AxisName) -> tuple[jax.Array, float]:
  """sqrt(mean_w ||x_w - mean_w x_w||^2) over `axis_name`, exactly, with its wire bytes.

  One all-reduce of the tree (the mean) and one of a scalar (the mean squared distance);
  the result is identical on every worker. None means one worker: distance 0, no bytes.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: consensus_distance(x, "data")[0], mesh=mesh,
    ...                   in_specs=jax.P("data"), out_specs=jax.P())
    >>> float(f(jnp.array([0.0, 2.0] * 4)))  # every worker is 1 away from the mean
    1.0
    >>> consensus_distance(jnp.ones(3), None)[1]  # one worker: nothing sent
    0.0
  """
  axes = comm.axis_names(axis_name)
  if not axes:
    return jnp.zeros((), jnp.float32), 0.0
  mean, b1 = comm.mean(tree, axes)
  local = sum(jnp.sum(jnp.square(x.astype(jnp.float32) - m.astype(jnp.float32)))
              for x, m in zip(jax.tree.leaves(tree), jax.tree.leaves(mean)))
  spread, b2 = comm.mean(local, axes)
  return jnp.sqrt(spread), b1 + b2


def stacked_consensus_distance(stacked: Any) -> float:
  """Consensus distance of per-worker values stored with a leading worker axis [W, ...].

  Use it on a Trainer's `state.params` (e.g. in `fit(..., eval_fn=...)`): it reads the state
  and puts no collective into the training step.

  >>> stacked_consensus_distance({"w": np.array([[0.0, 0.0], [2.0, 0.0]])})
  1.0
  """
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(stacked)]
  sq = sum(np.sum((x - x.mean(0, keepdims=True)) ** 2) for x in leaves)
  return float(np.sqrt(sq / leaves[0].shape[0]))


def _resolve(graph, num_workers) -> GossipGraph:
  if isinstance(graph, GossipGraph):
    if num_workers is not None and num_workers != graph.num_workers:
      raise ValueError(f"num_workers={num_workers} does not match the graph's "
                       f"{graph.num_workers} workers.")
    return graph
  if isinstance(graph, str):
    if num_workers is None:
      raise ValueError(f"graph {graph!r} given by name needs num_workers (the data axis size).")
    return gossip_graph(v.one_of("graph", graph, GRAPHS), num_workers)
  raise ValueError(f"graph must be a GossipGraph or a graph name, got {type(graph).__name__}.")


def _maybe_measure(measure: bool, params, axes, counter):
  if not measure:
    return None, counter
  dist, nbytes = consensus_distance(params, axes)
  return dist, comm.add_bytes(counter, nbytes)


class DpsgdState(NamedTuple):
  """State of `dpsgd`."""
  count: jax.Array               # i32[]: steps taken (selects a time-varying graph's phase)
  inner_state: Any               # the inner optimiser's state (per-worker: local gradients)
  consensus_distance: Any        # f32[] after the last step, or None when not measured
  wire_bytes: jax.Array          # u32[]: cumulative bytes sent (mod 2**32)


def dpsgd(inner: optax.GradientTransformation, graph: GossipGraph | str, *,
          num_workers: int | None = None, axis_name: comm.AxisName = "data",
          measure_consensus: bool = False) -> optax.GradientTransformationExtraArgs:
  """D-PSGD: x_i <- sum_j M[i, j] x_j + inner(g_i), with g_i the local gradient at x_i.

  Gossip of the current parameters and the local step are computed from the same x_i, as
  in Lian et al.'s algorithm; with plain SGD as `inner` the local step is -lr * g_i.

  Args:
    inner: the local optimiser (receives this worker's local gradient).
    graph: a `GossipGraph`, or a graph name (then `num_workers` is required).
    num_workers: the data axis size, when `graph` is a name.
    axis_name: the mesh axis the workers lie on; None means one worker (no gossip).
    measure_consensus: also compute the exact consensus distance after each step into the
      state (one extra parameter all-reduce per step, counted in `wire_bytes`).

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Lian et al., Can decentralized algorithms outperform centralized algorithms?,
    arXiv 1705.09056.

  >>> import jax.numpy as jnp, optax
  >>> tx = dpsgd(optax.sgd(0.5), "ring", num_workers=8, axis_name=None)
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> updates["w"], int(state.count)
  (Array([-0.5, -0.5], dtype=float32), 1)
  """
  inner = optax.with_extra_args_support(v.transform("inner", inner))
  graph = _resolve(graph, num_workers)
  axes = comm.axis_names(v.axis_name("axis_name", axis_name))

  def init_fn(params):
    return DpsgdState(count=jnp.zeros((), jnp.int32), inner_state=inner.init(params),
                      consensus_distance=jnp.zeros((), jnp.float32) if measure_consensus
                      else None, wire_bytes=comm.zero_bytes())

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axes, "sync.dpsgd")
    if params is None:
      raise ValueError("dpsgd needs params in update (it gossips the parameters).")
    local, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    mixed, counter = _mix_counted(params, graph, axes, state.count, state.wire_bytes)
    new_params = jax.tree.map(lambda m, u: m + u.astype(m.dtype), mixed, local)
    dist, counter = _maybe_measure(measure_consensus, new_params, axes, counter)
    out = jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new_params, params)
    return out, DpsgdState(count=state.count + 1, inner_state=inner_state,
                           consensus_distance=dist, wire_bytes=counter)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class ChocoState(NamedTuple):
  """State of `choco`."""
  count: jax.Array               # i32[]: steps taken
  inner_state: Any               # the inner optimiser's state (per-worker)
  public: jax.Array              # f32[n]: x_hat_i, the copy of x_i its neighbours hold
  neighbour_mix: jax.Array       # f32[n]: sum_j M[i, j] x_hat_j (self included)
  key: jax.Array                 # u32[2]: PRNG key, shared; folded with the worker index
  consensus_distance: Any        # f32[] after the last step, or None when not measured
  wire_bytes: jax.Array          # u32[]: cumulative bytes sent (mod 2**32)


def choco(inner: optax.GradientTransformation, graph: GossipGraph | str,
          codec: codecs.CodecLike, *, consensus_step: float = 1.0,
          num_workers: int | None = None,
          axis_name: comm.AxisName = "data", key: jax.Array | None = None,
          measure_consensus: bool = False) -> optax.GradientTransformationExtraArgs:
  """CHOCO-SGD: gossip of compressed differences, converging with any compressor.

  x_half = x_i + inner(g_i); q_i = C(x_half - x_hat_i) travels to every neighbour (one
  ppermute of the codec's payload each); x_hat_j += q_j for j in the neighbourhood and i;
  x_i <- x_half + gamma * sum_j M[i, j] (x_hat_j - x_hat_i). Each worker keeps only x_hat_i
  and s_i = sum_j M[i, j] x_hat_j (updated by the received q_j), so memory does not grow with
  the degree: sum_j M[i, j] (x_hat_j - x_hat_i) = s_i - x_hat_i since rows sum to one.
  With the identity codec and gamma = 1 this is x_i <- sum_j M[i, j] x_half_j exactly.

  Args:
    inner: the local optimiser (receives this worker's local gradient).
    graph: a static `GossipGraph` or a graph name (then `num_workers` is required).
    codec: any `jaxcomm.codecs.Codec`, or a factory `shapes -> Codec` of the parameters'
      leaf shapes; payloads are decoded per neighbour, so it need not be linear. Float
      payloads travel as their bit patterns.
    consensus_step: gamma in (0, 1]; smaller for more aggressive compression.
    num_workers: the data axis size, when `graph` is a name.
    axis_name: the mesh axis the workers lie on; None means one worker (no gossip).
    key: the codec's PRNG key (each worker folds in its index); None is the fixed default
      `jax.random.key(0)`.
    measure_consensus: as in `dpsgd`.

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Koloskova, Stich, Jaggi, Decentralized stochastic optimization and gossip algorithms
    with compressed communication, arXiv 1902.00340 (Algorithm 2).

  >>> import jax.numpy as jnp, optax
  >>> from jaxcomm import codecs
  >>> tx = choco(optax.sgd(0.5), "ring", codecs.identity(), num_workers=8, axis_name=None)
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> updates["w"], state.public
  (Array([-0.5, -0.5], dtype=float32), Array([0.5, 0.5], dtype=float32))
  """
  inner = optax.with_extra_args_support(v.transform("inner", inner))
  graph = _resolve(graph, num_workers)
  if graph.period != 1:
    raise ValueError(f"choco needs a static graph (each worker tracks its neighbours' public "
                     f"copies); {graph.name!r} is time-varying.")
  codecs.validate(codec)
  consensus_step = v.number("consensus_step", consensus_step, low=0.0, high=1.0,
                            low_open=True)
  axes = comm.axis_names(v.axis_name("axis_name", axis_name))
  key = v.key("key", key)

  def init_fn(params):
    codecs.for_tree(codec, params)  # a bad codec or factory fails here, before any step
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return ChocoState(count=jnp.zeros((), jnp.int32), inner_state=inner.init(params),
                      public=jnp.zeros((n,), jnp.float32),
                      neighbour_mix=jnp.zeros((n,), jnp.float32),
                      key=key,
                      consensus_distance=jnp.zeros((), jnp.float32) if measure_consensus
                      else None, wire_bytes=comm.zero_bytes())

  def exchange(codec, q, payload, counter):
    """sum_j M[i, j] q_j: decode each neighbour's payload, weight, add."""
    if not axes:
      return q, counter
    _check_axis(graph, axes)
    self_w, neigh_w = graph.weights(0)
    index = lax.axis_index(axes)
    mix = _weight(self_w, index, jnp.float32) * q
    wire = tuple(comm.to_bits(p) for p in payload)
    for src, w in zip(graph.sources[0], neigh_w):
      received, nbytes = comm.ppermute(wire, axes, _perm(src))
      decoded = codec.decode(tuple(comm.from_bits(r, p.dtype) for r, p in zip(received, payload)),
                             q.shape[0])
      mix = mix + _weight(w, index, jnp.float32) * decoded
      counter = comm.add_bytes(counter, nbytes)
    return mix, counter

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axes, "sync.choco")
    if params is None:
      raise ValueError("choco needs params in update (it gossips the parameters).")
    local, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    half = jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, local)
    c = codecs.for_tree(codec, half)
    flat_half, unflatten = codecs.flatten(half)
    key, sub = jax.random.split(state.key)
    worker_key = jax.random.fold_in(sub, lax.axis_index(axes)) if axes else sub
    payload = tuple(c.encode(flat_half - state.public, worker_key))
    q = c.decode(payload, flat_half.shape[0])
    public = state.public + q
    mix_q, counter = exchange(c, q, payload, state.wire_bytes)
    neighbour_mix = state.neighbour_mix + mix_q
    new_params = unflatten(flat_half + consensus_step * (neighbour_mix - public))
    dist, counter = _maybe_measure(measure_consensus, new_params, axes, counter)
    out = jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new_params, params)
    return out, ChocoState(count=state.count + 1, inner_state=inner_state, public=public,
                           neighbour_mix=neighbour_mix, key=key, consensus_distance=dist,
                           wire_bytes=counter)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
