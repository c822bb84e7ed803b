"""The checks behind `jaxcomm.parallel`'s public API (built on `jaxcomm._validate`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxcomm import _validate as v
from jaxcomm import codecs
from jaxcomm import comm
from jaxcomm import sync


def mesh_axes(name: str, value: Any, allowed: tuple) -> tuple:
  """A mesh axis, tuple of mesh axes, or None, each one of `allowed`: as a tuple."""
  axes = comm.axis_names(value)
  if not all(isinstance(a, str) for a in axes) or any(a not in allowed for a in axes):
    raise ValueError(f"{name} maps to unknown mesh axis name(s) {value!r}; allowed: "
                     f"{', '.join(allowed)}, a tuple of them, or None.")
  return axes


def rules_table(rules: Any) -> dict:
  """A dict or a sequence of (logical name, mesh axes) pairs, as a dict."""
  try:
    table = dict(rules)
  except (TypeError, ValueError):
    raise ValueError(f"rules must be a dict or a sequence of (logical name, mesh axes) "
                     f"pairs, got {rules!r}.") from None
  bad = [k for k in table if not isinstance(k, str) or not k]
  if bad:
    raise ValueError(f"rules keys must be logical axis names (non-empty strings), got {bad}.")
  return table


def mesh_shape(shape: Any, axis_names: Any, num_devices: int) -> tuple[tuple, tuple]:
  """(sizes, names) of a mesh over `num_devices` devices, from a dict or two sequences."""
  if isinstance(shape, dict):
    axis_names, shape = tuple(shape), tuple(shape.values())
  if not isinstance(shape, (tuple, list)):
    raise ValueError(f"shape must be a dict {{axis name: size}} or a sequence of sizes, "
                     f"got {shape!r}.")
  if axis_names is None:
    axis_names = ()
  if isinstance(axis_names, str) or not isinstance(axis_names, (tuple, list)):
    raise ValueError(f"axis_names must be a sequence of strings, got {axis_names!r}.")
  shape, axis_names = tuple(shape), tuple(axis_names)
  if len(shape) != len(axis_names):
    raise ValueError(f"shape {shape} and axis_names {axis_names} must have the same length.")
  if not shape:
    raise ValueError("a mesh needs at least one axis, got shape ().")
  v.axis_name("axis_names", axis_names, allow_none=False)
  sizes = dict(zip(axis_names, shape))
  if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 1
             for s in shape):
    raise ValueError(f"shape: mesh axis sizes must be integers >= 1, got {sizes}.")
  shape = tuple(int(s) for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(f"shape: mesh axis sizes {sizes} multiply to {math.prod(shape)}, but "
                     f"there are {num_devices} devices.")
  return shape, axis_names


def zero_args(inner, stage, axis_name, codec, memory, accumulate_steps, key):
  """The static choices of `zero`, normalised (`memory`: the resolved `sync.ErrorMemory`)."""
  v.transform("inner", inner)
  stage = v.integer("stage", stage, low=1, high=3)
  axis_name = v.axis_name("axis_name", axis_name)
  if codec is not None and not isinstance(codec, codecs.Codec):
    codecs.validate(codec, allow_none=True)  # a factory passes; anything else is refused
  if codec is not None and not codecs.splittable(codec):
    raise ValueError(f"codec {getattr(codec, 'name', codec)!r} needs the whole vector (it is "
                     f"built for one length or for the parameters' shapes), but ZeRO's "
                     f"reduce-scatter encodes 1/W chunks of it; use a codec that works on "
                     f"any length (e.g. codecs.top_k(0.01)) or None.")
  memory = sync.resolve_memory(memory, accumulate=False, stage="parallel.zero")
  if memory is not None and codec is None:
    raise ValueError("memory needs a codec (without compression nothing is dropped).")
  accumulate_steps = v.integer("accumulate_steps", accumulate_steps, low=1)
  if codec is not None and codec.stochastic:
    if key is None:
      raise ValueError(f"codec {codec.name!r} is stochastic: pass key=jax.random.key(...).")
  if key is not None:
    v.key("key", key)
  return stage, axis_name, memory, accumulate_steps
