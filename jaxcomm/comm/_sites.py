"""A two-level network: sites of devices, a fast link inside each site, a shared one between.

A job on S sites of d devices each (a mesh `replica=S, fsdp=d`, say) has two kinds of link:
`inside` a site every device sends at that link's bandwidth (NVLink, an InfiniBand port per
GPU); `between` sites the traffic crosses a link whose bandwidth is either per device
(`Link.per == "device"`: InfiniBand between the nodes of one datacenter) or per site
(`"site"`: a WAN or internet uplink). A per-site bandwidth is shared by the site's devices
that send over it at once, and in an SPMD step every device runs the same collective at the
same time: each of the d devices gets 1/d of it.

A collective's groups either stay inside a site (its mesh axes do not include the site
axis; charged on `inside` as `comm.Topology` would), or span sites. One over the site axis
alone (S devices, one per site) is charged on the between-link at a device's share. One
over the site axis and inner axes (q devices per site, S q in a group) runs hierarchically,
as collective libraries run across nodes (n: the operand bytes on one device, as
`Collective.operand_bytes`):

| collective         | phases                                                                |
|--------------------|-----------------------------------------------------------------------|
| all-reduce         | reduce-scatter inside (n, q), all-reduce between (n / q, S),          |
|                    | all-gather inside (n / q each, q)                                     |
| reduce-scatter     | reduce-scatter inside (n, q), reduce-scatter between (n / q, S)       |
| all-gather         | all-gather between (n each, S), all-gather inside (S n each, q)       |
| all-to-all         | all-to-all inside (n, q), all-to-all between (n, S)                   |
| collective-permute | one message between, at a device's share                              |

Each phase is charged by `comm.algorithm_times` on its link with `algorithm` ("auto": the
fastest per phase), and the phases add. The cross-site phase of an all-reduce moves
2 (S - 1) / S n / q bytes per device, d devices per site: the whole of 2 (S - 1) / S n per
site when q = d, as a flat ring over all S d devices would, at S - 1 latencies per phase
instead of S d - 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jaxcomm import _validate as v
from jaxcomm.comm._collectives import axis_names
from jaxcomm.comm._cost import Link
from jaxcomm.comm._cost import _as_link
from jaxcomm.comm._cost import _check_algorithm
from jaxcomm.comm._cost import _check_op
from jaxcomm.comm._cost import _pick
from jaxcomm.comm._cost import algorithm_times


@dataclasses.dataclass(frozen=True)
class Sites:
  """S sites of d devices: `inside` links a site's devices, `between` links the sites.

  Pass it wherever a topology is taken (`comm.cost`, `plan.predict`); module docstring for
  how each collective is charged.

  Args:
    sites: S, the number of sites (the size of the mesh axis `axis`).
    per_site: d, the devices in each site (the product of the other mesh axes).
    between: the link between sites (a `Link` or preset name); a per-site bandwidth
      (`per="site"`, as the `wan` and `internet` presets) is shared by the d devices.
    inside: the link inside a site, per device (default `nvlink`).
    axis: the mesh axis whose groups span sites (default `replica`).

  >>> net = Sites(2, 8, "wan")  # 2 sites x 8 devices, 1 Gbit/s per site between them
  >>> net.share.bandwidth * 8 / 1e9  # each device's share, Gbit/s
  0.125
  >>> name, seconds, _ = net.collective_seconds("all-reduce", 1e8, 2, ("replica",), "ring")
  >>> round(seconds, 3)  # 2 latencies of 30 ms + 2 (2 - 1) / 2 x 100 MB at 1/8 Gbit/s
  6.46
  """
  sites: int
  per_site: int
  between: Any
  inside: Any = "nvlink"
  axis: str = "replica"

  def __post_init__(self):
    v.integer("sites", self.sites, low=1)
    v.integer("per_site", self.per_site, low=1)
    object.__setattr__(self, "between", _as_link(self.between, "between"))
    object.__setattr__(self, "inside", _as_link(self.inside, "inside"))
    if not isinstance(self.axis, str) or not self.axis:
      raise ValueError(f"axis must be a mesh axis name (str), got {self.axis!r}.")

  @property
  def devices(self) -> int:
    """S d: every device of the job."""
    return self.sites * self.per_site

  @property
  def share(self) -> Link:
    """The between-link as one device sees it when every device of its site sends at once:
    a per-site bandwidth divided by d; a per-device one unchanged."""
    b = self.between
    if b.per == "device" or self.per_site == 1:
      return b
    return Link(b.bandwidth / self.per_site, b.latency, source=b.source, per="device",
                name=f"{b.name or 'between'}/{self.per_site}")

  def link(self, axes: str | Sequence[str] | None) -> Link:
    """The link a collective over `axes` is charged on: a device's share of the between-link
    when the axes include the site axis, else the inside link."""
    return self.share if self.axis in self._axes(axes) else self.inside

  def _axes(self, axes) -> tuple:
    names = axis_names(axes)
    if not names:
      raise ValueError("a collective whose mesh axes are unknown cannot be placed on sites: "
                       "read the report with its mesh (comm.parse_hlo(..., mesh=mesh)).")
    return names

  def phases(self, op: str, nbytes: float, group_size: int, axes) -> list:
    """[(op, operand bytes, group size, link)]: the collectives one over `axes` runs as
    (module docstring)."""
    _check_op(op)
    p = v.integer("group_size", group_size, low=1)
    if self.axis not in self._axes(axes):
      return [(op, nbytes, p, self.inside)]
    s = self.sites
    if p % s:
      raise ValueError(f"a collective over {axis_names(axes)} has groups of {p} devices, not a "
                       f"multiple of the {s} sites (axis {self.axis!r}): the mesh's "
                       f"{self.axis} axis must have one device per site.")
    q, share, inside = p // s, self.share, self.inside
    if op == "collective-permute":
      return [(op, nbytes, 2, share)]
    if q == 1:
      return [(op, nbytes, s, share)]
    return {
        "all-reduce": [("reduce-scatter", nbytes, q, inside), ("all-reduce", nbytes / q, s, share),
                       ("all-gather", nbytes / q, q, inside)],
        "reduce-scatter": [("reduce-scatter", nbytes, q, inside),
                           ("reduce-scatter", nbytes / q, s, share)],
        "all-gather": [("all-gather", nbytes, s, share), ("all-gather", s * nbytes, q, inside)],
        "all-to-all": [("all-to-all", nbytes, q, inside), ("all-to-all", nbytes, s, share)],
    }[op]

  def collective_seconds(self, op: str, nbytes: float, group_size: int, axes,
                         algorithm: str = "auto") -> tuple[str, float, Link]:
    """(algorithm charged, seconds, link) of one collective over `axes` (`comm.cost` calls
    it): its phases' seconds added, each phase's algorithm picked on its own."""
    _check_algorithm(algorithm)
    phases = self.phases(op, nbytes, group_size, axes)
    picked = [_pick(algorithm_times(o, n, g, l), algorithm) for o, n, g, l in phases]
    names = {a for a, _ in picked}
    name = names.pop() if len(names) == 1 else "mixed"
    if len(phases) > 1:
      name = f"hierarchical ({name})"
    crossing = [l for *_, l in phases if l is not self.inside]
    return name, sum(t for _, t in picked), crossing[0] if crossing else self.inside
