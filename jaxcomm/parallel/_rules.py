"""Logical parameter axes -> mesh axes: one rules table, one helper that makes the specs.

A model names each dimension of each parameter by what it is (`("embed", "mlp")` for an MLP
kernel); a rules table says which mesh axis each logical name is split over. Changing a
layout is changing the table, never the model. `param_specs` turns the names into
PartitionSpecs for a mesh and warns when too much of the model stays replicated.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import PartitionSpec as P

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.parallel import _validate
from jaxcomm.parallel._mesh import AXES
from jaxcomm.parallel._mesh import BATCH_AXES

Rules = tuple  # ((logical name, mesh axis | tuple of mesh axes | None), ...)

#: (logical dimension name, mesh axes) pairs: Megatron tensor parallelism over `tensor` and
#: ZeRO-3 / FSDP over `fsdp`. Embedding and vocabulary dimensions stay whole over `tensor`
#: (no vocab-parallel softmax here).
DEFAULT_RULES: Rules = (
    ("batch", ("replica", "data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("qkv", None),
    ("vocab", None),
    ("length", None),
    ("norm", None),
)


class ReplicationWarning(UserWarning):
  """Too large a share of the parameters is replicated on every device of a layout."""


def make_rules(rules: Mapping[str, Any] | Sequence | None = None, **overrides) -> Rules:
  """A validated rules table: `DEFAULT_RULES` (or `rules`) with `overrides` applied.

  Args:
    rules: a dict or sequence of (logical name, mesh axes) pairs; the defaults if None.
    **overrides: logical name = mesh axis (or tuple of axes, or None) to change or add.

  Returns:
    The table as a tuple of pairs (hashable, so layouts can be module fields).

  >>> dict(make_rules(embed="data"))["embed"]
  'data'
  """
  table = _validate.rules_table(DEFAULT_RULES if rules is None else rules)
  table.update(overrides)
  out = []
  for name, value in table.items():
    axes = _validate.mesh_axes(f"rules[{name!r}]", value, AXES)
    out.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
  return tuple(out)


def logical_to_spec(logical: Sequence[str | None], rules: Rules,
                    mesh_shape: Mapping[str, int], shape: Sequence[int] | None = None) -> P:
  """The PartitionSpec of one array whose dimensions have the given logical names.

  A mesh axis absent from the mesh (or of size 1) is dropped; a mesh axis already used by an
  earlier dimension is not used again; when `shape` is given, a dimension that the mesh axes
  do not divide stays whole.

  >>> logical_to_spec(("embed", "mlp"), DEFAULT_RULES, {"fsdp": 2, "tensor": 4})
  P('fsdp', 'tensor')
  """
  table = dict(rules)
  used, entries = set(), []
  for i, name in enumerate(logical):
    if name is None:
      entries.append(None)
      continue
    if name not in table:
      raise ValueError(f"logical axis {name!r} has no rule; the rules cover "
                       f"{sorted(table)}.")
    axes = tuple(a for a in comm.axis_names(table[name])
                 if mesh_shape.get(a, 1) > 1 and a not in used)
    if axes and shape is not None and shape[i] % math.prod(mesh_shape[a] for a in axes):
      axes = ()
    used.update(axes)
    entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*entries)


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def spec_axes(spec: P) -> frozenset:
  """The mesh axes a PartitionSpec shards over.

  >>> sorted(spec_axes(P(("data", "fsdp"), None, "tensor")))
  ['data', 'fsdp', 'tensor']
  """
  return frozenset(a for entry in spec for a in comm.axis_names(entry))


def replicated_fraction(params: Any, specs: Any, axes: Sequence[str]) -> float:
  """Share of parameter elements whose spec shards them over none of `axes`.

  >>> import jax.numpy as jnp
  >>> params = {"w": jnp.zeros((4, 6)), "b": jnp.zeros(8)}
  >>> replicated_fraction(params, {"w": P(None, "tensor"), "b": P()}, ["tensor"])
  0.25
  """
  total = replicated = 0
  for x, spec in zip(jax.tree.leaves(params),
                     jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
    n = math.prod(x.shape)
    total += n
    replicated += n if not spec_axes(spec) & set(axes) else 0
  return replicated / total if total else 0.0


def param_specs(logical_axes: Any, rules: Rules, mesh: jax.sharding.Mesh, params: Any = None,
                *, max_replicated: float = 0.5) -> Any:
  """PartitionSpecs of a parameter tree from the logical names of its dimensions.

  Args:
    logical_axes: a tree like the parameters whose leaves are tuples of logical names (one
      per dimension), e.g. `TransformerLM.param_axes()`.
    rules: the rules table (see `make_rules`).
    mesh: the mesh the specs are for.
    params: the parameters (arrays or ShapeDtypeStructs): dimensions the mesh axes do not
      divide stay whole. Without them every rule applies.
    max_replicated: warn (`ReplicationWarning`) when more than this share of the parameter
      elements is replicated over every non-batch mesh axis (and every batch axis the rules
      shard parameters over) of size > 1.

  Returns:
    A tree of `PartitionSpec`s like the parameters.

  >>> mesh = jax.make_mesh((8,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> param_specs({"w": ("embed", "mlp")}, DEFAULT_RULES, mesh)
  {'w': P(None, 'tensor')}
  """
  shape = dict(v.mesh("mesh", mesh).shape)
  max_replicated = v.number("max_replicated", max_replicated, low=0.0, high=1.0)
  leaves, treedef = jax.tree.flatten(logical_axes, is_leaf=_is_axes)
  arrays = [None] * len(leaves) if params is None else treedef.flatten_up_to(params)
  specs = []
  for names, x in zip(leaves, arrays):
    if x is not None and len(names) != len(x.shape):
      raise ValueError(f"logical axes {names} do not match a parameter of shape {x.shape}.")
    specs.append(logical_to_spec(names, rules, shape, None if x is None else x.shape))
  specs = jax.tree.unflatten(treedef, specs)
  if params is not None:
    _warn_if_replicated(params, specs, rules, shape, max_replicated)
  return specs


def _warn_if_replicated(params, specs, rules, mesh_shape, max_replicated):
  param_axes = {a for name, v in rules if name != "batch" for a in comm.axis_names(v)}
  axes = [a for a, n in mesh_shape.items()
          if n > 1 and (a not in BATCH_AXES or a in param_axes)]
  if not axes:
    return
  frac = replicated_fraction(params, specs, axes)
  if frac > max_replicated:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    rep = sorted(((math.prod(x.shape), jax.tree_util.keystr(path))
                  for (path, x), s in zip(flat, spec_leaves) if not spec_axes(s) & set(axes)),
                 reverse=True)[:3]
    warnings.warn(f"{frac:.0%} of the parameters are replicated over mesh axes {axes} "
                  f"(largest: {', '.join(f'{k} ({n:,})' for n, k in rep)}); change the rules "
                  "to shard them.", ReplicationWarning, stacklevel=3)
