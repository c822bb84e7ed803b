"""What communication costs on a network: the latency-bandwidth (alpha-beta) model.

A message of n bytes over a link takes `alpha + n * beta` seconds: `alpha` is the link's
per-message latency and `beta = 1 / bandwidth`. A collective algorithm is a schedule of
such messages, so its time is (steps) * alpha + (bytes each device sends) * beta. With p
devices in the group, L = ceil(log2 p), and n the operand bytes on one device (for
all-gather: each device's contribution), the algorithms charged here are
(Thakur, Rabenseifner & Gropp, IJHPCA 19(1), 2005; Chan et al., CCPE 19(13), 2007):

| collective         | "ring"                   | "tree"                 | "halving_doubling"      |
|--------------------|--------------------------|------------------------|-------------------------|
| all-reduce         | 2(p-1)a + 2(p-1)/p n b   | L (a + n b) [1]        | 2L a + 2(p-1)/p n b [4] |
| all-gather         | (p-1)a + (p-1) n b       | L a + (p-1) n b [1, 3] | as "tree"               |
| reduce-scatter     | (p-1)a + (p-1)/p n b     | L a + (p-1)/p n b [2]  | as "tree"               |
| all-to-all         | (p-1)a + (p-1)/p n b [5] | L a + L n/2 b [3]      | as "ring"               |
| collective-permute | a + n b                  | a + n b                | a + n b                 |

[1] recursive doubling, [2] recursive halving, [3] Bruck, [4] Rabenseifner, [5] pairwise.

"auto" charges the fastest of the three, as MPI libraries and NCCL's tuner pick the
log-latency algorithms for small messages. The ring's bandwidth term is exactly the wire
bytes of docs/algorithms.md (what `comm.inspect` and the state counters report). For p not a
power of two the log-step algorithms are charged ceil(log2 p) steps (Bruck's bound; MPICH's
fold to a power of two adds up to two steps). The model sees no contention, no congestion
and no overlap of steps with each other: on real networks the ring usually wins for large
messages, which the model cannot show, and the log algorithms are then only a lower bound.

A collective over several mesh axes (a flat ring over the product) runs at the pace of its
slowest link: bandwidth is the smallest and latency the largest of the axes' links.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

from jaxcomm import _validate as v
from jaxcomm.comm._collectives import axis_names
from jaxcomm.comm._inspect import Collective
from jaxcomm.comm._inspect import CollectiveReport

#: The collectives `cost` prices (HLO op names, as `Collective.op` holds them).
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
#: How a collective is priced: ring, tree, recursive halving and doubling, or "auto" (the
#: cheapest of the three for each collective's size and link).
ALGORITHMS = ("ring", "tree", "halving_doubling", "auto")
_CONCRETE = ALGORITHMS[:-1]


def _finite(value: Any, name: str, *, positive: bool) -> float:
  try:
    value = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number, got {value!r}.") from None
  if not math.isfinite(value) or value < 0 or (positive and value == 0):
    bound = "> 0" if positive else ">= 0"
    raise ValueError(f"{name} must be finite and {bound}, got {value!r}.")
  return value


@dataclasses.dataclass(frozen=True)
class Link:
  """A class of network link: how fast one device sends over it, and its latency.

  Args:
    bandwidth: bytes per second one device sends in one direction (beta = 1 / bandwidth).
    latency: seconds per message (alpha), including the software stack.
    name: a label for tables.
    source: where the numbers come from.

  >>> link = Link.gbit(100, 20e-6)
  >>> link.bandwidth, link.latency
  (12500000000.0, 2e-05)
  """
  bandwidth: float
  latency: float
  name: str = dataclasses.field(default="", compare=False)
  source: str = dataclasses.field(default="", compare=False)

  def __post_init__(self):
    object.__setattr__(self, "bandwidth", _finite(self.bandwidth, "bandwidth", positive=True))
    object.__setattr__(self, "latency", _finite(self.latency, "latency", positive=False))

  @classmethod
  def gbit(cls, gbit_per_s: float, latency: float, **kwargs) -> "Link":
    """A link of `gbit_per_s` Gbit/s (10**9 bits) per direction and `latency` seconds."""
    rate = _finite(gbit_per_s, "gbit_per_s", positive=True)
    return cls(rate * 1e9 / 8, latency, **kwargs)


#: Links by name (`Link`, with its source). Bandwidth is per device and per direction;
#: where a vendor quotes a bidirectional figure it is halved. Latencies are end-to-end per
#: message of a collective library on that fabric (not the bare wire); they are
#: order-of-magnitude assumptions and marked so where no vendor figure exists.
PRESETS: dict[str, Link] = {
    "tpu_ici": Link(
        100e9, 1e-6, name="tpu_ici",
        source="Cloud TPU v5e docs: 400 GBps bidirectional ICI per chip over 4 ports of a 2-D "
               "torus; a bidirectional ring along one torus axis uses 2 ports: 2 x 50 GB/s = "
               "100 GB/s per direction. Latency ~1 us per hop (assumed, unverified)."),
    "nvlink": Link(
        450e9, 5e-6, name="nvlink",
        source="NVIDIA H100 SXM datasheet: NVLink 4, 900 GB/s bidirectional per GPU = 450 "
               "GB/s per direction. Latency ~5 us, a typical NCCL small-message figure inside "
               "one node (assumed)."),
    "infiniband": Link.gbit(
        400, 5e-6, name="infiniband",
        source="InfiniBand NDR (NVIDIA ConnectX-7 / Quantum-2), 400 Gbit/s per port; RoCE at "
               "400 GbE is the same class. Latency ~5 us end-to-end through a switch with a "
               "collective library (assumed; switch hops are ~0.1-0.6 us)."),
    "ethernet_100g": Link.gbit(
        100, 25e-6, name="ethernet_100g",
        source="100 Gigabit Ethernet (IEEE 802.3ba) with kernel TCP; latency ~25 us per "
               "message through the TCP stack (assumed)."),
    "ethernet_10g": Link.gbit(
        10, 50e-6, name="ethernet_10g",
        source="10 Gigabit Ethernet (IEEE 802.3ae) with kernel TCP; latency ~50 us (assumed)."),
    "wan": Link.gbit(
        1, 30e-3, name="wan",
        source="A cross-datacenter link: 1 Gbit/s available to the job and 30 ms one way "
               "(~60 ms round trip, the order of US east-west coast paths); the setting of "
               "low-communication training across datacenters (DiLoCo, arXiv 2311.08105). "
               "Both numbers are assumptions a user should replace with their own."),
    "internet": Link.gbit(
        0.1, 40e-3, name="internet",
        source="Workers of independent providers over the public internet, the regime of "
               "OpenDiLoCo (arXiv 2407.07852: two continents, three countries) and INTELLECT-1 "
               "(arXiv 2412.01152: 14 nodes on three continents). The numbers are assumptions, "
               "not those papers': 100 Mbit/s available to the job per worker and 40 ms one "
               "way (~80 ms round trip, the order of a transatlantic path)."),
}


def preset(name: str) -> Link:
  """The preset link called `name` (see `PRESETS` for the numbers and their sources).

  >>> preset("wan").latency
  0.03
  """
  return PRESETS[v.one_of("name", name, PRESETS)]


def _as_link(spec: Any, argname: str) -> Link:
  if isinstance(spec, Link):
    return spec
  if isinstance(spec, str):
    if spec not in PRESETS:
      raise ValueError(f"{argname} {spec!r} is not a preset; allowed: {', '.join(PRESETS)}.")
    return PRESETS[spec]
  raise ValueError(f"{argname} must be a Link or a preset name ({', '.join(PRESETS)}), "
                   f"got {spec!r}.")


@dataclasses.dataclass(frozen=True)
class Topology:
  """The link each mesh axis communicates over.

  Args:
    links: mesh axis name -> `Link` (or preset name).
    default: the link of every axis not in `links`, and of collectives whose axes are
      unknown (a report read without a mesh); None makes those an error.

  >>> topo = Topology({"data": "wan", "tensor": "nvlink"})
  >>> slow = topo.link(("data", "tensor"))  # a collective over both runs at the WAN's pace
  >>> slow.bandwidth == preset("wan").bandwidth, slow.latency == preset("wan").latency
  (True, True)
  """
  links: Mapping[str, Link] = dataclasses.field(default_factory=dict)
  default: Link | None = None

  def __post_init__(self):
    if not isinstance(self.links, Mapping):
      raise ValueError(f"links must map mesh axis names to links, got {self.links!r}.")
    links = {}
    for axis, spec in self.links.items():
      if not isinstance(axis, str):
        raise ValueError(f"links keys must be mesh axis names (str), got {axis!r}.")
      links[axis] = _as_link(spec, f"links[{axis!r}]")
    object.__setattr__(self, "links", links)
    if self.default is not None:
      object.__setattr__(self, "default", _as_link(self.default, "default"))

  @classmethod
  def uniform(cls, link: Link | str) -> "Topology":
    """Every axis on the same link."""
    return cls({}, default=_as_link(link, "link"))

  def link(self, axes: str | Sequence[str] | None) -> Link:
    """The link a collective over `axes` runs at: the slowest of the axes' links."""
    axes = axis_names(axes)
    found = []
    for axis in axes or (None,):
      if axis in self.links:
        found.append(self.links[axis])
      elif self.default is not None:
        found.append(self.default)
      else:
        what = f"mesh axis {axis!r}" if axis else "a collective whose mesh axes are unknown"
        raise ValueError(f"the topology has no link for {what}; it knows axes "
                         f"{sorted(self.links)}: add the axis or a default link.")
    if len(found) == 1:
      return found[0]
    slow = min(found, key=lambda l: l.bandwidth)
    return Link(slow.bandwidth, max(l.latency for l in found),
                name="+".join(l.name or "?" for l in found))


def topology(spec: Any) -> Topology:
  """A `Topology` from a preset name, a `Link`, a dict {axis: Link | preset}, or a Topology.

  >>> topology("ethernet_10g").link("data").name
  'ethernet_10g'
  """
  if isinstance(spec, Topology):
    return spec
  if isinstance(spec, (str, Link)):
    return Topology.uniform(_as_link(spec, "topology"))
  if isinstance(spec, Mapping):
    return Topology(spec)
  raise ValueError(f"topology must be a preset name ({', '.join(PRESETS)}), a Link, a dict "
                   f"of mesh axis -> link, or a Topology; got {spec!r}.")


def _check_op(op: str) -> None:
  v.one_of("op", op, OPS)


def _check_algorithm(algorithm: str) -> None:
  v.one_of("algorithm", algorithm, ALGORITHMS)


def _steps_and_bytes(op: str, algorithm: str, n: float, p: int) -> tuple[float, float]:
  """(messages in sequence, bytes one device sends) of one collective."""
  log = math.ceil(math.log2(p))
  if op == "collective-permute":
    return 1, n
  if op == "all-reduce":
    return {"ring": (2 * (p - 1), 2 * (p - 1) / p * n),
            "tree": (log, log * n),
            "halving_doubling": (2 * log, 2 * (p - 1) / p * n)}[algorithm]
  if op == "all-gather":
    return ((p - 1), (p - 1) * n) if algorithm == "ring" else (log, (p - 1) * n)
  if op == "reduce-scatter":
    return ((p - 1), (p - 1) / p * n) if algorithm == "ring" else (log, (p - 1) / p * n)
  # all-to-all: pairwise exchange, or Bruck for "tree".
  return (log, log * n / 2) if algorithm == "tree" else ((p - 1), (p - 1) / p * n)


def _count(value: Any, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
     or value < 1:
    raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
  return int(value)


def algorithm_times(op: str, nbytes: float, group_size: int, link: Link) -> dict[str, float]:
  """Seconds of one collective under each algorithm ("ring", "tree", "halving_doubling").

  Example:
    >>> t = algorithm_times("all-reduce", 4000, 8, Link(1e9, 1e-5))
    >>> sorted(t), round(t["ring"], 9)  # 14 latencies + 2 * 7/8 * 4 KB / 1 GB/s
    (['halving_doubling', 'ring', 'tree'], 0.000147)
  """
  _check_op(op)
  nbytes = _finite(nbytes, "nbytes", positive=False)
  p = _count(group_size, "group_size")
  v.instance("link", link, Link, "Link (see comm.preset)")
  if p == 1 or (op == "collective-permute" and nbytes == 0):
    return {a: 0.0 for a in _CONCRETE}
  out = {}
  for a in _CONCRETE:
    steps, sent = _steps_and_bytes(op, a, nbytes, p)
    out[a] = steps * link.latency + sent / link.bandwidth
  return out


def _pick(times: dict, algorithm: str) -> tuple[str, float]:
  if algorithm == "auto":
    name = min(_CONCRETE, key=lambda a: (times[a], _CONCRETE.index(a)))
    return name, times[name]
  return algorithm, times[algorithm]


def collective_time(op: str, nbytes: float, group_size: int, link: Link | str,
                    algorithm: str = "auto") -> float:
  """Seconds one collective takes on `link` (alpha-beta model, see the module docstring).

  Args:
    op: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or "collective-permute".
    nbytes: operand bytes on one device (for all-gather: each device's contribution), as
      `Collective.operand_bytes` reports them.
    group_size: p, the devices in the group.
    link: a `Link` or a preset name.
    algorithm: "ring", "tree", "halving_doubling" or "auto" (the fastest).

  Returns:
    Seconds.

  >>> link = Link(bandwidth=1e9, latency=1e-5)
  >>> round(collective_time("all-reduce", 4e6, 8, link, "ring"), 9)  # 14 a + 7 MB / 1 GB/s
  0.00714
  """
  _check_algorithm(algorithm)
  return _pick(algorithm_times(op, nbytes, group_size, _as_link(link, "link")), algorithm)[1]


def _ring_factor(op: str, p: int) -> float:
  """Wire bytes per operand byte under the ring convention of docs/algorithms.md."""
  return _steps_and_bytes(op, "ring", 1.0, p)[1] if p > 1 else 0.0


def wire_bytes_time(wire_bytes: float, topology_or_link: Any, *, group_size: int,
                    op: str = "all-reduce", axes: str | Sequence[str] | None = None,
                    messages: int = 1, algorithm: str = "ring") -> float:
  """Seconds for wire bytes counted in state (docs/algorithms.md convention) to travel.

  The counters know bytes, not collectives: the bytes are taken as `messages` equal
  collectives of kind `op` over `group_size` devices, so the bandwidth term is exact and the
  latency term is that of `messages` collectives. With a compiled step at hand, `cost` on
  `comm.inspect`'s report counts the real collectives.

  Args:
    wire_bytes: per-device wire bytes, as counted in a stage's `wire_bytes` field.
    topology_or_link: a `Topology`, `Link`, preset name or dict (see `topology`).
    group_size: devices in each collective's group.
    op: the kind of collective the bytes went through.
    axes: the mesh axes (to pick the link from a Topology).
    messages: how many collectives carried the bytes.
    algorithm: see `collective_time`.

  >>> round(wire_bytes_time(7e6, Link(1e9, 1e-5), group_size=8), 9)  # the ring all-reduce above
  0.00714
  """
  wire_bytes = _finite(wire_bytes, "wire_bytes", positive=False)
  messages = _count(messages, "messages")
  p = _count(group_size, "group_size")
  _check_op(op)
  _check_algorithm(algorithm)
  link = topology(topology_or_link).link(axes)
  if wire_bytes == 0 or p == 1:
    return 0.0
  factor = _ring_factor(op, p)
  nbytes = wire_bytes / factor / messages
  return messages * collective_time(op, nbytes, group_size, link, algorithm)


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
  """The modelled time of one collective of a compiled program."""
  collective: Collective
  link: Link
  algorithm: str   # the algorithm charged ("auto" resolved to the fastest)
  seconds: float   # one execution

  @property
  def total_seconds(self) -> float:
    """Seconds per call of the program (times the enclosing loops' trip counts)."""
    return self.seconds * self.collective.trips


@dataclasses.dataclass(frozen=True)
class CommCost:
  """Modelled times of every collective of a compiled program (see `cost`)."""
  costs: tuple

  def __iter__(self):
    return iter(self.costs)

  def __len__(self):
    return len(self.costs)

  def select(self, *, op=None, axes=None, conditional=None) -> list:
    out = []
    for c in self.costs:
      col = c.collective
      if op is not None and col.op != op:
        continue
      if axes is not None and tuple(col.axes) != tuple(axes):
        continue
      if conditional is not None and col.in_conditional != conditional:
        continue
      out.append(c)
    return out

  def seconds(self, *, op: str | None = None, axes: Sequence[str] | None = None,
              conditional: bool | None = None) -> float:
    """Seconds of one call with every selected collective run (serially), filtered like
    `CollectiveReport.wire_bytes`: `conditional=False` is what runs on every call."""
    return sum(c.total_seconds for c in self.select(op=op, axes=axes, conditional=conditional))

  def wire_bytes(self, *, conditional: bool | None = None) -> float:
    return sum(c.collective.total_bytes for c in self.select(conditional=conditional))

  def by_axis(self) -> dict:
    """Seconds per mesh-axis tuple."""
    out: dict = {}
    for c in self.costs:
      out[c.collective.axes] = out.get(c.collective.axes, 0.0) + c.total_seconds
    return out

  def table(self) -> str:
    """A printable table, one row per collective."""
    head = (f"{'op':<19}{'axes':<14}{'W':>3}{'trips':>6}{'cond':>6}{'wire bytes':>14}"
            f"  {'link':<22}{'algorithm':<17}{'seconds':>12}")
    rows = [head, "-" * len(head)]
    for c in self.costs:
      col = c.collective
      rows.append(f"{col.op:<19}{','.join(col.axes) or '?':<14}{col.group_size:>3}"
                  f"{col.trips:>6}{'yes' if col.in_conditional else '':>6}"
                  f"{col.total_bytes:>14,.0f}  {(c.link.name or '-')[:21]:<22}{c.algorithm:<17}"
                  f"{c.total_seconds:>12.6f}")
    rows.append(f"{'total':<48}{self.wire_bytes():>14,.0f}{'':<41}{self.seconds():>12.6f}")
    return "\n".join(rows)

  def __str__(self):
    return self.table()


def _operand_bytes(col: Collective) -> list:
  """Bytes of each operand of a (possibly multi-operand) collective.

  The report keeps one dtype set per collective, so bytes are shared out by element count:
  exact when the operands have one dtype, as XLA's combiner produces.
  """
  shapes = col.shape
  if not shapes or isinstance(shapes[0], int):
    return [col.operand_bytes]
  sizes = [math.prod(s) for s in shapes]
  total = sum(sizes)
  return [col.operand_bytes * n / total if total else 0.0 for n in sizes]


def cost(report: CollectiveReport | Iterable[Collective], topology_spec: Any,
         algorithm: str = "auto", *, split_operands: bool = False) -> CommCost:
  """Modelled time of every collective `comm.inspect` found in a compiled program.

  Args:
    report: a `CollectiveReport` (or any iterable of `Collective`).
    topology_spec: a `Topology`, `Link`, preset name or dict {axis: link} (see `topology`).
    algorithm: "ring", "tree", "halving_doubling" or "auto" (fastest per collective).
    split_operands: how a multi-operand collective (XLA combines many small all-reduces
      into one tuple all-reduce) runs. False: as one collective of the summed bytes, one
      latency schedule. True: one collective per operand, each paying the latency, which
      is what XLA:CPU's gloo collectives do (measured by benchmarks/shaped_link.py).

  Returns:
    A `CommCost`: `.seconds()` per call (`conditional=False`: what runs on every call),
    `.table()` to print.

  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
  ...                   in_specs=P("data"), out_specs=P())
  >>> from jaxcomm.comm import inspect
  >>> c = cost(inspect(f, jnp.ones(8000), mesh=mesh), Link(1e9, 1e-5), "ring")
  >>> round(c.seconds(), 9)  # 14 latencies + 2 * 7/8 * 4 KB / 1 GB/s
  0.000147
  """
  _check_algorithm(algorithm)
  topo = topology(topology_spec)
  costs = []
  for col in report:
    if not isinstance(col, Collective):
      raise ValueError(f"report must hold comm.Collective entries, got {col!r}.")
    link = topo.link(col.axes)
    parts = _operand_bytes(col) if split_operands else [col.operand_bytes]
    picked = [_pick(algorithm_times(col.op, n, col.group_size, link), algorithm)
              for n in parts]
    seconds = sum(t for _, t in picked)
    if col.op == "collective-permute" and col.wire_bytes == 0:
      seconds = 0.0
    name = picked[0][0] if len({a for a, _ in picked}) == 1 else "mixed"
    costs.append(CollectiveCost(collective=col, link=link, algorithm=name, seconds=seconds))
  return CommCost(tuple(costs))
