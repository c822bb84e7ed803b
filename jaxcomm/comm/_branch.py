"""Conditionals whose branches differ in which values vary over the manual mesh axes.

Inside `jax.shard_map` a value carries the manual axes it may vary over. A branch that
synchronises returns results of collectives (invariant over the axis) where the other
returns per-worker values, and `lax.cond` / `lax.switch` require every branch to return the
same types. `cond` and `switch` trace each branch once abstractly and cast every output leaf
to vary over the union of what the branches give it (`varying`), so a schedule can write
"sync every H steps" as one conditional with the bytes counted inside the branch that sends.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import lax

from jaxcomm.comm._collectives import varying, varying_axes


def _reconciled(branches: Sequence[Callable], operands: tuple) -> list[Callable]:
  """The branches with each output leaf cast to the union of the branches' varying axes."""
  shapes = [jax.eval_shape(b, *operands) for b in branches]
  want = jax.tree.map(lambda *xs: frozenset().union(*(varying_axes(x) for x in xs)), *shapes)

  def cast(branch):
    def run(*ops):
      return jax.tree.map(lambda x, axes: varying(x, tuple(sorted(axes))), branch(*ops), want)
    return run

  return [cast(b) for b in branches]


def switch(index: jax.Array, branches: Sequence[Callable], *operands) -> Any:
  """`lax.switch` whose branches may differ in the manual axes their outputs vary over.

  Args:
    index: i32[] branch index (clamped to the range, as in `lax.switch`).
    branches: callables of `*operands` returning trees of the same structure, shapes and
      dtypes.
    *operands: the branches' arguments.

  Returns:
    The chosen branch's output, each leaf varying over every axis some branch varies it over.

  Example:
    >>> import jax.numpy as jnp
    >>> switch(jnp.int32(1), [lambda x: x, lambda x: 2 * x], jnp.ones(2))
    Array([2., 2.], dtype=float32)
  """
  branches = _reconciled(branches, operands)
  if len(branches) == 1:
    return branches[0](*operands)
  return lax.switch(index, branches, *operands)


def cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, *operands) -> Any:
  """`lax.cond` whose branches may differ in the manual axes their outputs vary over.

  E.g. a branch that returns `comm.mean(x, "data")` (invariant) and one that returns `x`
  (per worker): both outputs are cast to vary over "data".

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> step = lambda x, sync: cond(sync, lambda y: jax.lax.pmean(y, "data"), lambda y: y, x)
    >>> f = jax.shard_map(step, mesh=mesh, in_specs=(jax.P("data"), jax.P()),
    ...                   out_specs=jax.P("data"))
    >>> f(jnp.arange(8.0), True).tolist() == [3.5] * 8
    True
  """
  true_fn, false_fn = _reconciled([true_fn, false_fn], operands)
  return lax.cond(pred, true_fn, false_fn, *operands)
