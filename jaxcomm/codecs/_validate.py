"""The checks behind the codecs' public factories (built on `jaxcomm._validate`)."""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

from jaxcomm import _validate as v


def cast_dtype(value: Any, allowed: Mapping[str, Any]) -> str:
  """The name of a narrow float dtype `cast` supports (a dtype or its name)."""
  name = value
  if not isinstance(value, str):
    try:
      name = jnp.dtype(value).name if value is not None else value
    except (TypeError, ValueError):
      pass
  try:
    return v.one_of("cast dtype", name, sorted(allowed))
  except ValueError:
    raise ValueError(f"cast dtype must be one of {sorted(allowed)}, got {value!r}.") from None
