"""Reading the collectives out of a compiled program.

`inspect(fn, *args)` compiles `fn` for `args`, parses the optimised HLO text and reports every
collective: op, dtype, operand shape, the mesh axes its replica groups span, its wire bytes
(per device, docs/algorithms.md conventions), whether it sits inside a conditional branch
(and which), and how many times an enclosing loop with a known trip count runs it. This is
the independent check of the bytes the transforms count in their state.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Sequence

import jax
import numpy as np

from jaxcomm.comm import _collectives

_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2,
    "f32": 4, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1, "f4e2m1fn": 0.5, "f8e8m0fnu": 1,
    "c64": 8, "c128": 16,
}
_KINDS = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_PARAM_RE = re.compile(r"%?([\w.\-]+):\s*"
                       r"((?:\([^)]*\))|(?:[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?))")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program."""
  op: str                      # all-reduce | all-gather | reduce-scatter | all-to-all |
                               # collective-permute
  dtype: str                   # HLO element type of the operand(s), e.g. 'f32' or 'bf16,s32'
  shape: tuple                 # operand shape(s) on one device
  axes: tuple                  # mesh axis names the groups span (() if unknown)
  group_size: int              # W: devices in one replica group
  operand_bytes: float         # bytes of the operand(s) on one device
  wire_bytes: float            # per-device wire bytes for one execution
  in_conditional: bool         # inside a branch of a conditional (runs only sometimes)
  trips: int                   # executions per call (known loop trip counts multiplied)
  name: str                    # the HLO instruction name
  # The innermost conditional branch computation that runs it ("" outside conditionals):
  # collectives of one branch run together, those of different branches apart.
  branch: str = ""

  @property
  def total_bytes(self) -> float:
    return self.wire_bytes * self.trips


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
  """All collectives of a compiled program, with helpers to total and print them."""
  collectives: tuple

  def __iter__(self):
    return iter(self.collectives)

  def __len__(self):
    return len(self.collectives)

  def wire_bytes(self, *, op: str | None = None, axes: Sequence[str] | None = None,
                 conditional: bool | None = None) -> float:
    """Total per-device wire bytes of one call, optionally filtered."""
    return sum(c.total_bytes for c in self.select(op=op, axes=axes, conditional=conditional))

  def select(self, *, op=None, axes=None, conditional=None) -> list:
    out = []
    for c in self.collectives:
      if op is not None and c.op != op:
        continue
      if axes is not None and tuple(c.axes) != tuple(axes):
        continue
      if conditional is not None and c.in_conditional != conditional:
        continue
      out.append(c)
    return out

  def by_axis(self) -> dict:
    """Wire bytes per mesh-axis tuple."""
    out: dict = {}
    for c in self.collectives:
      out[c.axes] = out.get(c.axes, 0.0) + c.total_bytes
    return out

  def table(self) -> str:
    """A printable table, one row per collective."""
    head = (f"{'op':<19}{'dtype':<10}{'shape':<22}{'axes':<18}"
            f"{'W':>3}{'trips':>6}{'cond':>6}{'wire bytes':>14}")
    rows = [head, "-" * len(head)]
    for c in self.collectives:
      shape = str(c.shape) if c.shape and isinstance(c.shape[0], int) or not c.shape else \
          f"{len(c.shape)} arrays"
      rows.append(f"{c.op:<19}{c.dtype:<10}{shape:<22}{','.join(c.axes) or '?':<18}"
                  f"{c.group_size:>3}{c.trips:>6}{'yes' if c.in_conditional else '':>6}"
                  f"{c.total_bytes:>14,.0f}")
    rows.append(f"{'total':<76}{self.wire_bytes():>14,.0f}")
    return "\n".join(rows)

  def __str__(self):
    return self.table()


def _shapes(type_text: str) -> list:
  return [(dt, tuple(int(d) for d in dims.split(",") if d))
          for dt, dims in _ARRAY_RE.findall(type_text)]


def _nbytes(shapes) -> float:
  return sum(math.prod(s) * _DTYPE_BYTES.get(dt, 4) for dt, s in shapes)


def _split_computations(hlo: str) -> dict:
  comps, name, entry = {}, None, None
  for line in hlo.splitlines():
    m = _COMP_RE.match(line)
    if m and not line.lstrip().startswith(("ROOT", "%param")) and "=" not in line.split("(")[0]:
      name = m.group(2)
      comps[name] = {"lines": [], "params": m.group(3) or ""}
      if m.group(1):
        entry = name
      continue
    if name is not None:
      if line.strip() == "}":
        name = None
      else:
        comps[name]["lines"].append(line)
  return {"comps": comps, "entry": entry}


def _iota_groups(text: str) -> list:
  # Format: [G,S]<=[d0,d1,...]T(p0,p1,...)
  m = re.match(r"\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
  g, s = int(m.group(1)), int(m.group(2))
  dims = [int(d) for d in m.group(3).split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if m.group(4):
    ids = ids.transpose([int(p) for p in m.group(4).split(",")])
  return [list(r) for r in ids.reshape(g, s)]


def _replica_groups(attrs: str) -> list | None:
  m = re.search(r"replica_groups=(\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)", attrs)
  if m:
    return _iota_groups(m.group(1))
  m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
  if m:
    groups = [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    return [g for g in groups if g] or None
  return None


def _pairs(attrs: str) -> list:
  m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
  return [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", m.group(1))] if m else []


def _axis_groups(mesh, axes: tuple) -> set:
  """The replica groups a collective over `axes` has on `mesh` (flat logical device ids)."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  names = list(mesh.axis_names)
  keep = [names.index(a) for a in axes]
  rest = [i for i in range(len(names)) if i not in keep]
  moved = ids.transpose(rest + keep).reshape(-1, math.prod(ids.shape[i] for i in keep))
  return {frozenset(r.tolist()) for r in moved}


def _axes_of_groups(mesh, groups) -> tuple:
  if mesh is None or not groups:
    return ()
  target = {frozenset(g) for g in groups}
  names = tuple(mesh.axis_names)
  for r in range(1, len(names) + 1):
    for combo in itertools.combinations(names, r):
      if _axis_groups(mesh, combo) == target:
        return combo
  return ()


def _axes_of_pairs(mesh, pairs) -> tuple:
  if mesh is None or not pairs:
    return ()
  shape = mesh.devices.shape
  differ = set()
  for s, t in pairs:
    cs, ct = np.unravel_index(s, shape), np.unravel_index(t, shape)
    differ |= {mesh.axis_names[i] for i in range(len(shape)) if cs[i] != ct[i]}
  return tuple(a for a in mesh.axis_names if a in differ)


def _find_mesh(args) -> Any:
  for leaf in jax.tree.leaves(args):
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and getattr(mesh, "devices", None) is not None:
      return mesh
  return None


def parse_hlo(hlo: str, mesh=None, num_devices: int | None = None) -> CollectiveReport:
  """Parses optimised HLO text into a `CollectiveReport` (see `inspect`).

  Example:
    >>> import jax.numpy as jnp
    >>> report = parse_hlo(compiled_text(lambda x: x * 2, jnp.ones(4)), num_devices=1)
    >>> report.wire_bytes()  # no collective in a one-device program
    0
  """
  parsed = _split_computations(hlo)
  comps, entry = parsed["comps"], parsed["entry"]
  # Symbol tables and call edges per computation.
  symbols, calls = {}, {}
  for cname, comp in comps.items():
    table = {p: t for p, t in _PARAM_RE.findall(comp["params"])}
    edges = []
    for line in comp["lines"]:
      m = _INSTR_RE.match(line)
      if not m:
        continue
      iname, itype, op, rest = m.groups()
      table[iname] = itype
      trips = 1
      tc = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
      if op == "while" and tc:
        trips = int(tc.group(1))
      for key, cond in (("to_apply", False), ("calls", False), ("body", False),
                        ("condition", False), ("true_computation", True),
                        ("false_computation", True)):
        for callee in re.findall(rf"\b{key}=%?([\w.\-]+)", rest):
          edges.append((callee, cond, trips if key == "body" else 1))
      bm = re.search(r"branch_computations=\{([^}]*)\}", rest)
      if bm:
        for callee in re.findall(r"%?([\w.\-]+)", bm.group(1)):
          edges.append((callee, True, 1))
    symbols[cname], calls[cname] = table, edges
  # Context (in a conditional?, trip multiplier, innermost branch) of each computation
  # reached from ENTRY.
  context = {}
  stack = [(entry, False, 1, "")] if entry else [(c, False, 1, "") for c in comps]
  while stack:
    cname, cond, trips, branch = stack.pop()
    if cname not in comps or context.get(cname) == (cond, trips, branch):
      continue
    context[cname] = (cond, trips, branch)
    for callee, c2, t2 in calls.get(cname, []):
      stack.append((callee, cond or c2, trips * t2, callee if c2 else branch))
  found = []
  for cname, comp in comps.items():
    if cname not in context:
      continue
    cond, trips, branch = context[cname]
    for line in comp["lines"]:
      m = _INSTR_RE.match(line)
      if not m or m.group(3) not in _KINDS:
        continue
      iname, _, op, rest = m.groups()
      kind = _KINDS[op]
      operand_text = rest.split(")", 1)[0]
      operands = re.findall(r"%([\w.\-]+)", operand_text)
      shapes = [s for o in operands for s in _shapes(symbols[cname].get(o, ""))]
      if not shapes:  # Operand types printed inline.
        shapes = _shapes(operand_text)
      nbytes = _nbytes(shapes)
      if kind == "collective-permute":
        pairs = _pairs(rest)
        axes, w = _axes_of_pairs(mesh, pairs), 2
        wire = nbytes if pairs else 0.0
      else:
        groups = _replica_groups(rest)
        if groups is None:
          n = num_devices or (mesh.devices.size if mesh is not None else 1)
          groups = [list(range(n))]
        axes, w = _axes_of_groups(mesh, groups), len(groups[0])
        wire = {"all-reduce": _collectives.allreduce_bytes,
                "all-gather": _collectives.all_gather_bytes,
                "reduce-scatter": _collectives.reduce_scatter_bytes,
                "all-to-all": _collectives.all_to_all_bytes}[kind](nbytes, w)
      found.append(Collective(
          op=kind, dtype=",".join(sorted({dt for dt, _ in shapes})),
          shape=shapes[0][1] if len(shapes) == 1 else tuple(s for _, s in shapes),
          axes=tuple(axes), group_size=w, operand_bytes=nbytes, wire_bytes=wire,
          in_conditional=cond, trips=trips, name=iname, branch=branch))
  return CollectiveReport(tuple(found))


def compiled_text(fn, *args, **kwargs) -> str:
  """Optimised HLO text of `fn` compiled for `args` (jit-wrapped if needed).

  Example:
    >>> import jax.numpy as jnp
    >>> "HloModule" in compiled_text(lambda x: x * 2, jnp.ones(4))
    True
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  return jitted.lower(*args, **kwargs).compile().as_text()


def inspect(fn, *args, mesh=None, **kwargs) -> CollectiveReport:
  """Compiles `fn(*args, **kwargs)` and reports every collective in the optimised program.

  Args:
    fn: a function or jitted function (typically a shard_map'd training step).
    *args: example arguments (arrays or `jax.ShapeDtypeStruct`s with shardings).
    mesh: the mesh used to map replica groups back to axis names; found from the
      arguments' shardings when omitted.
    **kwargs: keyword arguments for `fn`.

  Returns:
    A `CollectiveReport`; `print(report)` shows the table, `report.wire_bytes()` the total.

  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
  ...                   in_specs=P("data"), out_specs=P())
  >>> report = inspect(f, jnp.ones(64), mesh=mesh)
  >>> report.collectives[0].op, report.collectives[0].axes, report.wire_bytes()
  ('all-reduce', ('data',), 56.0)
  """
  if mesh is None:
    mesh = _find_mesh((args, kwargs))
  return parse_hlo(compiled_text(fn, *args, **kwargs), mesh=mesh,
                   num_devices=None if mesh is not None else jax.device_count())
