"""DiLoCo whose outer all-reduce is gossip over a graph: Factored Gossip DiLoCo and GASLoC.

Every worker i keeps its own outer parameters x_i and outer optimiser state. After each H
inner steps (round k) it has its own outer gradient Delta_i = x_i - theta_i and its own outer
step u_i = OuterOpt_i(Delta_i) (for SGD, -lr Delta_i); M is the graph's mixing matrix, and
every worker restarts its inner steps from its new x_i.

* Factored Gossip DiLoCo: x_i <- (M x)_i + u_i, plus (M u)_i - u_i on every
  `blocking_every`-th round, i.e. x <- M (x + u) there. DiLoCo's exact sync J (x + u) is
  J x + J u; the first term is known when the round starts, so its gossip can run during the
  H inner steps (non-blocking, and it mixes the current x, nothing stale); the second needs
  the round's result (blocking). Our reading of arXiv 2606.22768 from its abstract: which
  variable each mixing step gossips and how often the blocking one runs are our choices
  (one non-blocking gossip every round, one blocking gossip every `blocking_every`).
* GASLoC (arXiv 2606.11081): y_i = x_i + u_i;
  x_i <- y_i - a (L y)_i + g (y_i - y_i^prev), with L = I - M the graph Laplacian of the
  mixing weights, a = `gossip_step` and g = `momentum` (the accelerated variant, g > 0;
  no momentum term in the first round). a = 1, g = 0 gives x <- M y. The paper's step sizes
  were not at hand: a = 1 and g = 0 are our defaults, not its settings.

With the complete graph (M = J: every worker averages all) and a blocking step every round,
both are DiLoCo: the workers' x stay equal, and the mean of their outer steps is the outer
step of the mean outer gradient for a linear outer optimiser (SGD, momentum, Nesterov).

Bytes per round and worker: degree x |theta| x 4 per gossip (one `ppermute` per neighbour of
one flat buffer): Factored: one gossip, two on blocking rounds; GASLoC: one. Parameters
sharded over fsdp / tensor inside a replica are gossiped shard by shard. Both are written on
`local.periodic`: a sync rule and the per-worker outer state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm, sync
from jaxcomm.local import _periodic


class GossipDilocoState(NamedTuple):
  """State of `factored_gossip_diloco` and `gasloc`."""
  count: jax.Array       # i32[]: inner steps taken
  inner_state: Any       # the inner optimiser's state (per-worker)
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)
  outer_params: Any      # like params: this worker's outer parameters x_i (per-worker)
  outer_state: Any       # this worker's outer optimiser state (per-worker)
  previous: Any = None   # like params: y_i of the last round (GASLoC with momentum); or None


def _connected(graph: sync.GossipGraph) -> bool:
  """Whether the union of the graph's phases connects every worker to every other (following
  the direction of the edges), so repeated gossip reaches consensus."""
  adj = np.zeros((graph.num_workers,) * 2, bool)
  for m in graph.matrices:
    adj |= m > 0
  reach = np.eye(graph.num_workers, dtype=bool)
  for _ in range(graph.num_workers):
    reach = reach | (reach.astype(int) @ adj.astype(int) > 0)
  return bool(reach.all())


def _graph(graph: Any, num_workers: int | None) -> sync.GossipGraph:
  if isinstance(graph, str):
    if num_workers is None:
      raise ValueError(f"graph {graph!r} given by name needs num_workers (the axis size).")
    graph = sync.gossip_graph(v.one_of("graph", graph, sync.GRAPHS), num_workers)
  if not isinstance(graph, sync.GossipGraph):
    raise ValueError(f"graph must be a GossipGraph or a graph name, got {graph!r}.")
  if num_workers is not None and num_workers != graph.num_workers:
    raise ValueError(f"num_workers={num_workers} does not match the graph's "
                     f"{graph.num_workers} workers.")
  if not _connected(graph):
    raise ValueError(f"graph {graph.name!r} does not connect its {graph.num_workers} workers "
                     "(not even over all its phases): gossip would never reach consensus.")
  return graph


def _mix(tree, graph, axes, phase, wire):
  """(M tree)_i for this worker, as one flat buffer per neighbour; the counter updated."""
  if not axes:
    return tree, wire
  flat, unflatten = codecs.flatten(tree)
  mixed, nbytes = sync.gossip(flat, graph, axes, phase if graph.period > 1 else 0)
  return unflatten(mixed), comm.add_bytes(wire, nbytes)


def _build(inner, outer, sync_every: int, graph, axis_name, rule, name: str,
           keep_previous: bool) -> optax.GradientTransformationExtraArgs:
  """The schedule on `local.periodic`; `rule(x, u, previous, k, wire) -> (x, previous, wire)`
  is the sync of round k (adding its bytes to the counter `wire` where it sends)."""
  axes = comm.axis_names(axis_name)

  def init_fn(params):
    if axes and comm.axis_size(axes) != graph.num_workers:
      raise ValueError(f"graph {graph.name!r} has {graph.num_workers} workers but axis_name "
                       f"{axis_name!r} has {comm.axis_size(axes)}.")
    return dict(outer_params=jax.tree.map(jnp.asarray, params), outer_state=outer.init(params),
                previous=jax.tree.map(jnp.asarray, params) if keep_previous else None)

  def sync_fn(local, state, sync):
    x = state.outer_params
    step, outer_state = outer.update(jax.tree.map(jnp.subtract, x, local), state.outer_state, x)
    x, previous, wire = rule(x, step, state.previous, sync.index, state.wire_bytes)
    return x, state._replace(outer_params=x, outer_state=outer_state, previous=previous,
                             wire_bytes=wire), 0

  return _periodic.periodic(inner, sync_every, sync_fn, init_fn=init_fn,
                            state_type=GossipDilocoState, axis_name=axis_name, name=name)


def _common(inner, outer, sync_every, axis_name, graph, num_workers):
  sync_every = v.integer("sync_every", sync_every, low=1, high=2**30)
  axis_name = v.axis_name("axis_name", axis_name)
  return inner, v.transform("outer", outer), sync_every, axis_name, _graph(graph, num_workers)


def factored_gossip_diloco(inner: optax.GradientTransformation,
                           outer: optax.GradientTransformation, sync_every: int,
                           graph: sync.GossipGraph | str, *, blocking_every: int = 1,
                           num_workers: int | None = None, axis_name: comm.AxisName = "data"
                           ) -> optax.GradientTransformationExtraArgs:
  """Factored Gossip DiLoCo: a non-blocking gossip of the outer parameters every round, a
  blocking gossip of the outer step every `blocking_every` rounds (module docstring).

  Args:
    inner: the optimiser each worker runs.
    outer: the outer optimiser, one copy per worker (Nesterov SGD as DiLoCo's).
    sync_every: H >= 1, inner steps per round.
    graph: a connected `sync.GossipGraph` (time-varying graphs use phase k at round k), or
      a graph name (then `num_workers` is required).
    blocking_every: rounds between blocking gossips (1: every round).
    num_workers: the size of `axis_name`, when `graph` is a name.
    axis_name: the replica axis; None: one worker (no gossip).

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Hewa Koneputugodage et al., Factored Gossip DiLoCo: Reducing Blocking Communication in
    DiLoCo, arXiv 2606.22768.

  >>> import jax.numpy as jnp, optax
  >>> tx = factored_gossip_diloco(optax.sgd(0.1), optax.sgd(1.0), 1, "ring", num_workers=8,
  ...                             axis_name=None)
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> state.outer_params["w"]  # one worker: DiLoCo, x - 1.0 * 0.1
  Array([0.9, 0.9], dtype=float32)
  """
  inner, outer, sync_every, axis_name, graph = _common(inner, outer, sync_every, axis_name,
                                                       graph, num_workers)
  blocking_every = v.integer("blocking_every", blocking_every, low=1)
  axes = comm.axis_names(axis_name)

  def rule(x, u, previous, k, wire):
    mixed, wire = _mix(x, graph, axes, k, wire)  # non-blocking: x is known at the start

    def blocking(u, wire):
      return _mix(u, graph, axes, k, wire)

    if blocking_every > 1:
      u, wire = comm.cond((k + 1) % blocking_every == 0, blocking, lambda *ops: ops, u, wire)
    else:
      u, wire = blocking(u, wire)
    return jax.tree.map(jnp.add, mixed, u), previous, wire

  return _build(inner, outer, sync_every, graph, axis_name, rule, "factored_gossip_diloco",
                keep_previous=False)


def gasloc(inner: optax.GradientTransformation, outer: optax.GradientTransformation,
           sync_every: int, graph: sync.GossipGraph | str, *, gossip_step: float = 1.0,
           momentum: float = 0.0, num_workers: int | None = None,
           axis_name: comm.AxisName = "data") -> optax.GradientTransformationExtraArgs:
  """GASLoC: each worker's outer step, then a graph-Laplacian gossip term and (accelerated)
  momentum on the post-step iterates (module docstring).

  Args:
    inner: the optimiser each worker runs.
    outer: the outer optimiser, one copy per worker.
    sync_every: H >= 1, inner steps per round.
    graph: a connected `sync.GossipGraph` (e.g. `sync.random_matchings`: one random peer
      per round), or a graph name (then `num_workers` is required).
    gossip_step: a in (0, 1]: x <- y - a L y.
    momentum: g in [0, 1): the accelerated variant's g (y - y_prev); 0: none.
    num_workers: the size of `axis_name`, when `graph` is a name.
    axis_name: the replica axis; None: one worker (no gossip).

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Cagnasso, Belilovsky, Oyallon, Unifying Local Communications and Local Updates for LLM
    Pretraining (GASLoC), arXiv 2606.11081.

  >>> import jax.numpy as jnp, optax
  >>> tx = gasloc(optax.sgd(0.1), optax.sgd(1.0), 1, "ring", num_workers=8, axis_name=None)
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> state.outer_params["w"]
  Array([0.9, 0.9], dtype=float32)
  """
  inner, outer, sync_every, axis_name, graph = _common(inner, outer, sync_every, axis_name,
                                                       graph, num_workers)
  gossip_step = v.number("gossip_step", gossip_step, low=0.0, high=1.0, low_open=True)
  momentum = v.number("momentum", momentum, low=0.0, high=1.0, high_open=True)
  axes = comm.axis_names(axis_name)

  def rule(x, u, previous, k, wire):
    y = jax.tree.map(jnp.add, x, u)
    mixed, wire = _mix(y, graph, axes, k, wire)
    g = jnp.where(k > 0, momentum, 0.0)
    new = jax.tree.map(lambda y, m, p: y + gossip_step * (m - y) + g.astype(y.dtype) * (y - p),
                       y, mixed, previous if momentum else y)
    return new, (y if momentum else None), wire

  return _build(inner, outer, sync_every, graph, axis_name, rule, "gasloc",
                keep_previous=momentum > 0)
