"""Argument checks shared by every subpackage: bad input fails early and clearly.

Each check raises `ValueError` naming the argument, the allowed values and what it got, and
returns the value normalised (a Python int, a float, a `jnp.dtype`, a tuple of axis names).
Factories call them while resolving their static choices, before building any closure, so a
mistake surfaces where the transform or layout is built and never inside a trace.

This module imports nothing of jaxcomm, so every subpackage (codecs included) may use it
without breaking the one-way layering (CONTRIBUTING.md). A plain argument check (a number, a
choice, a flag, a type) calls these directly, so the same mistake reads the same everywhere;
a subpackage's `_validate.py` holds only its domain checks (shape relations, mesh facts,
schedules), built from these.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Collection

import jax
import jax.numpy as jnp
import numpy as np


def integer(name: str, value: Any, *, low: int | None = None, high: int | None = None,
            allow_none: bool = False) -> int | None:
  """An integer in [low, high] (either bound optional); bools are not integers here.

  With `allow_none`, None is allowed too (and returned).
  """
  if allow_none and value is None:
    return None
  ok = isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, bool)
  if ok:
    value = int(value)
    ok = (low is None or value >= low) and (high is None or value <= high)
  if not ok:
    none = "None or " if allow_none else ""
    raise ValueError(f"{name} must be {none}an integer{_range(low, high)}, got {value!r}.")
  return value


def number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> float:
  """A finite real number in the given interval (open or closed at each end)."""
  ok = isinstance(value, (numbers.Real, np.floating, np.integer)) and not isinstance(value, bool)
  if ok:
    value = float(value)
    ok = math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or (value < high if high_open else value <= high))
  if not ok:
    where = ""
    if (low, high) != (None, None):
      lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low}"
      hi = "inf)" if high is None else f"{high}" + (")" if high_open else "]")
      where = f" in {lo}, {hi}"
    raise ValueError(f"{name} must be a finite number{where}, got {value!r}.")
  return value


def flag(name: str, value: Any) -> bool:
  """True or False (not 0 or 1, which `one_of` would take for them)."""
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be True or False, got {value!r}.")
  return value


def one_of(name: str, value: Any, allowed: Collection) -> Any:
  """One of `allowed` (compared with ==; unhashable values are simply not allowed)."""
  try:
    ok = value in allowed
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")
  return value


def dtype(name: str, value: Any, *, kind: Any = jnp.floating) -> np.dtype:
  """A dtype of the given kind (`jnp.floating` by default), as `jnp.dtype`."""
  try:
    dt = None if value is None or isinstance(value, bool) else jnp.dtype(value)
  except (TypeError, ValueError):
    dt = None
  if dt is None or not jnp.issubdtype(dt, kind):
    what = "a floating dtype (e.g. bfloat16, float32)" if kind is jnp.floating else \
        f"a {getattr(kind, '__name__', kind)} dtype"
    raise ValueError(f"{name} must be {what}, got {value!r}.")
  return dt


def axis_name(name: str, value: Any, *, allow_none: bool = True) -> Any:
  """A mesh axis name: a non-empty string, a tuple/list of distinct ones, or None (one device).

  Returns the value with a list turned into a tuple.
  """
  ok = True
  if value is None:
    ok = allow_none
  elif isinstance(value, str):
    ok = bool(value)
  elif isinstance(value, (tuple, list)):
    ok = (len(value) > 0 and all(isinstance(a, str) and a for a in value)
          and len(set(value)) == len(value))
    value = tuple(value) if ok else value
  else:
    ok = False
  if not ok:
    none = " or None (one device)" if allow_none else ""
    raise ValueError(f"{name} must be a non-empty string or a tuple of distinct non-empty "
                     f"strings (mesh axis names){none}, got {value!r}.")
  return value


def key(name: str, value: Any) -> jax.Array:
  """A JAX PRNG key, returned as its raw uint32 key data (checkpointable state).

  Accepts a typed key (`jax.random.key(0)`) or raw key data (`jax.random.PRNGKey(0)`) of
  JAX's default implementation; None is the fixed default `jax.random.key(0)`, so a
  transform built without a key is still reproducible.
  """
  default = jax.random.key(0)
  if value is None:
    return jax.random.key_data(default)
  if isinstance(value, (jax.Array, np.ndarray)):
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
      if value.shape == () and jax.random.key_impl(value) == jax.random.key_impl(default):
        return jax.random.key_data(value)
    elif value.dtype == np.uint32 and value.shape == jax.random.key_data(default).shape:
      return jnp.asarray(value)
  raise ValueError(f"{name} must be one PRNG key of JAX's default implementation "
                   f"(jax.random.key(0)) or None (that fixed default), got {value!r}.")


def instance(name: str, value: Any, cls: type | tuple, what: str) -> Any:
  """An instance of `cls`; `what` describes it for the message (e.g. "jax.sharding.Mesh (see
  jaxcomm.parallel.make_mesh)")."""
  if not isinstance(value, cls):
    raise ValueError(f"{name} must be a {what}, got {value!r}.")
  return value


def mesh(name: str, value: Any) -> jax.sharding.Mesh:
  """A `jax.sharding.Mesh`."""
  return instance(name, value, jax.sharding.Mesh,
                  "jax.sharding.Mesh (see jaxcomm.parallel.make_mesh)")


def specs(name: str, value: Any) -> Any:
  """A tree of `PartitionSpec`s (a None leaf is not one)."""
  is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)
  if not all(is_spec(s) for s in jax.tree.leaves(value, is_leaf=lambda s: s is None or
                                                 is_spec(s))):
    raise ValueError(f"{name} must be a tree of PartitionSpecs, got {value!r}.")
  return value


def callable_(name: str, value: Any, *, allow_none: bool = False) -> Any:
  """Anything callable (or None, with `allow_none`)."""
  if not (callable(value) or (allow_none and value is None)):
    none = " or None" if allow_none else ""
    raise ValueError(f"{name} must be callable{none}, got {value!r}.")
  return value


def transform(name: str, value: Any) -> Any:
  """An optax `GradientTransformation`: something with callable `init` and `update`."""
  if not (callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))):
    raise ValueError(f"{name} must be an optax GradientTransformation (with init and update), "
                     f"got {value!r}.")
  return value


def _range(low, high) -> str:
  if low is not None and high is not None:
    return f" in [{low}, {high}]"
  if low is not None:
    return f" >= {low}"
  if high is not None:
    return f" <= {high}"
  return ""
