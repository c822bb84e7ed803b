"""Gossip graphs: mixing matrices built once in numpy, validated, executed as ppermutes.

A graph on W workers is a doubly stochastic mixing matrix M (M[i, j] is the weight worker i
gives worker j's value) together with the permutations that carry it: each permutation is one
`ppermute` in which every worker receives from exactly one peer, so one gossip round sends
one buffer per permutation. A time-varying graph has one matrix per phase and uses phase
`t mod period` at step t.

Weights: undirected graphs (ring, torus, complete) use Metropolis-Hastings weights
M[i, j] = 1 / (1 + max(d_i, d_j)), symmetric and doubly stochastic for any degrees; on the
regular graphs built here that is 1 / (d + 1) everywhere. The exponential graphs are directed
(worker i receives from i - 2^k) with uniform weights, doubly stochastic but not symmetric
(Ying et al., arXiv 2110.13363).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxcomm import _validate as v

#: The gossip graphs `gossip_graph` builds (and `dpsgd` and `choco` take) by name.
GRAPHS = ("ring", "torus", "exponential", "complete", "one_peer_exponential")


@dataclasses.dataclass(frozen=True, eq=False)
class GossipGraph:
  """A validated (possibly time-varying) gossip graph on `num_workers` workers.

  Attributes:
    name: the graph's name (one of `GRAPHS`).
    num_workers: W, the size of the mesh axis it runs on.
    matrices: one mixing matrix f64[W, W] per phase.
    sources: per phase, a tuple of int arrays src[W]: in that ppermute worker i receives
      from worker src[i]. Together with the diagonal they cover the matrix's support.
    directed: whether the graph is directed (its matrices need not be symmetric).
  """
  name: str
  num_workers: int
  matrices: tuple
  sources: tuple
  directed: bool

  @property
  def period(self) -> int:
    """Number of phases (1 for a static graph)."""
    return len(self.matrices)

  def degree(self, phase: int = 0) -> int:
    """Number of peers each worker receives from (= ppermutes) in `phase`."""
    return len(self.sources[phase])

  def second_eigenvalue(self, phase: int = 0) -> float:
    """Second-largest singular value of M: the per-round contraction of disagreement.

    For a symmetric M this is the second-largest |eigenvalue|; repeated gossip shrinks the
    consensus distance by this factor per round (asymptotically).
    """
    return float(np.linalg.svd(self.matrices[phase], compute_uv=False)[1])

  def weights(self, phase: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """(self weights f64[W], [neighbour weights f64[W] per ppermute]) of `phase`."""
    m = self.matrices[phase]
    idx = np.arange(self.num_workers)
    return np.diag(m).copy(), [m[idx, src] for src in self.sources[phase]]


def _check(graph: GossipGraph) -> GossipGraph:
  """Raises ValueError unless every phase is doubly stochastic, carried by its ppermutes."""
  n = graph.num_workers
  for phase, (m, sources) in enumerate(zip(graph.matrices, graph.sources)):
    where = f"graph {graph.name!r} (phase {phase})"
    if m.shape != (n, n) or np.any(m < 0):
      raise ValueError(f"{where}: mixing matrix must be non-negative of shape ({n}, {n}).")
    if not (np.allclose(m.sum(0), 1, atol=1e-12) and np.allclose(m.sum(1), 1, atol=1e-12)):
      raise ValueError(f"{where}: mixing matrix is not doubly stochastic.")
    if not graph.directed and not np.allclose(m, m.T, atol=1e-12):
      raise ValueError(f"{where}: undirected graph needs a symmetric mixing matrix.")
    carried = np.eye(n, dtype=bool)
    for src in sources:
      if sorted(src.tolist()) != list(range(n)) or np.any(src == np.arange(n)):
        raise ValueError(f"{where}: each ppermute must be a permutation without fixed points.")
      carried[np.arange(n), src] = True
    if np.any((m > 0) & ~carried):
      raise ValueError(f"{where}: mixing matrix has weight on pairs no ppermute carries.")
  return graph


def _from_sources(name: str, n: int, sources: list[np.ndarray], directed: bool,
                  weight: float | None = None) -> tuple[np.ndarray, tuple]:
  """Mixing matrix of one phase: uniform `weight`, or Metropolis-Hastings when None."""
  unique = []
  for src in sources:  # On small graphs two offsets can be one permutation: send it once.
    if not any(np.array_equal(src, u) for u in unique):
      unique.append(np.asarray(src, np.int64))
  adj = np.zeros((n, n), dtype=bool)
  for src in unique:
    adj[np.arange(n), src] = True
  if weight is not None:
    m = adj * weight
  else:
    deg = adj.sum(1)
    m = adj / (1.0 + np.maximum(deg[:, None], deg[None, :]))
  m[np.diag_indices(n)] = 1.0 - m.sum(1)
  return m, tuple(unique)


def _shift(n: int, offset: int) -> np.ndarray:
  """Sources of a ring shift: worker i receives from i - offset."""
  return (np.arange(n) - offset) % n


def _torus_shape(n: int, shape) -> tuple[int, int]:
  if shape is None:
    rows = max((r for r in range(2, math.isqrt(n) + 1) if n % r == 0), default=None)
    if rows is None:
      raise ValueError(f"a torus needs num_workers = rows * cols with rows, cols >= 2; "
                       f"{n} has no such factorisation (use 'ring').")
    shape = (rows, n // rows)
  shape = tuple(int(s) for s in shape)
  if len(shape) != 2 or min(shape) < 2 or shape[0] * shape[1] != n:
    raise ValueError(f"torus shape must be (rows, cols) with rows, cols >= 2 and "
                     f"rows * cols = num_workers = {n}; got shape={shape}.")
  return shape


def _torus_sources(n: int, shape) -> list[np.ndarray]:
  rows, cols = _torus_shape(n, shape)
  r, c = np.divmod(np.arange(n), cols)
  return [((r - dr) % rows) * cols + (c - dc) % cols
          for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))]


def gossip_graph(name: str, num_workers: int, *, shape=None) -> GossipGraph:
  """Builds and validates a gossip graph.

  Args:
    name: `"ring"` (peers i +- 1), `"torus"` (2-D, peers one row / column away),
      `"exponential"` (directed, peers 2^k hops away, k = 0..floor(log2(W-1))),
      `"complete"` (uniform weights 1/W: the exact mean), or `"one_peer_exponential"`
      (time-varying: at step t the single peer 2^(t mod log2 W) hops away, weights 1/2).
    num_workers: W, the size of the mesh axis the graph runs on (>= 2).
    shape: `(rows, cols)` of a torus; by default the most square factorisation of W.

  Returns:
    A `GossipGraph` whose mixing matrices are doubly stochastic (and symmetric for the
    undirected graphs).

  Raises:
    ValueError: an unknown name, W < 2, or a shape that does not fit W.

  References:
    Lian et al., D-PSGD, arXiv 1705.09056; Ying et al., exponential graphs,
    arXiv 2110.13363; Assran et al., SGP (one-peer exponential), arXiv 1811.10792.

  >>> g = gossip_graph("ring", 8)
  >>> g.degree(), round(float(g.matrices[0][0, 1]), 4), round(g.second_eigenvalue(), 4)
  (2, 0.3333, 0.8047)
  >>> gossip_graph("one_peer_exponential", 8).period
  3
  """
  name = v.one_of("graph", name, GRAPHS)  # the graph's name: what sync.dpsgd calls `graph`
  n = v.integer("num_workers", num_workers, low=2)  # a gossip graph joins two workers or more
  if shape is not None and name != "torus":
    raise ValueError(f"shape applies only to the 'torus' graph, not {name!r}.")
  hops = [2**k for k in range(int(math.log2(n - 1)) + 1)] if n > 2 else [1]
  if name == "ring":
    phases, directed = [_from_sources(name, n, [_shift(n, 1), _shift(n, -1)], False)], False
  elif name == "torus":
    phases, directed = [_from_sources(name, n, _torus_sources(n, shape), False)], False
  elif name == "complete":
    phases = [_from_sources(name, n, [_shift(n, k) for k in range(1, n)], False, 1.0 / n)]
    directed = False
  elif name == "exponential":
    phases = [_from_sources(name, n, [_shift(n, h) for h in hops], True, 1.0 / (len(hops) + 1))]
    directed = True
  else:  # one_peer_exponential
    phases = [_from_sources(name, n, [_shift(n, h)], True, 0.5) for h in hops]
    directed = True
  return _check(GossipGraph(name=name, num_workers=n, matrices=tuple(m for m, _ in phases),
                            sources=tuple(s for _, s in phases), directed=directed))


def random_matchings(num_workers: int, count: int = 8, seed: int = 0) -> GossipGraph:
  """A time-varying graph of `count` random perfect matchings (pairs), drawn from `seed`.

  Phase p pairs the workers by a random permutation π_p of 0..W-1 (numpy's generator seeded
  with `seed`): π_p[2i] with π_p[2i+1]. Each phase is one `ppermute` in which every worker
  receives from its partner; the mixing weights are 1/2 (the pair's average). Every process
  that builds it with the same seed gets the same pairs, so no coordination is needed.

  Args:
    num_workers: W, even and >= 2.
    count: number of phases (distinct draws), >= 1.
    seed: the shared seed.

  Returns:
    A `GossipGraph` named "random_matching" with `period == count`.

  References:
    Kolehmainen et al., NoLoCo, arXiv 2506.10911 (random pairs each outer step).

  >>> g = random_matchings(8, count=3, seed=0)
  >>> partner = g.sources[0][0]  # phase 0: worker i receives from partner[i]
  >>> g.period, g.degree(0), bool((partner[partner] == range(8)).all())
  (3, 1, True)
  """
  if v.integer("num_workers", num_workers, low=2) % 2:
    raise ValueError(f"num_workers must be even for random matchings, got {num_workers!r}.")
  count = v.integer("count", count, low=1)
  seed = v.integer("seed", seed, low=0)
  n, rng = int(num_workers), np.random.default_rng(int(seed))
  phases = []
  for _ in range(int(count)):
    perm = rng.permutation(n)
    partner = np.empty(n, np.int64)
    partner[perm[0::2]], partner[perm[1::2]] = perm[1::2], perm[0::2]
    phases.append(_from_sources("random_matching", n, [partner], False, 0.5))
  return _check(GossipGraph(name="random_matching", num_workers=n,
                            matrices=tuple(m for m, _ in phases),
                            sources=tuple(s for _, s in phases), directed=False))
