"""Wire-byte counters kept in optimiser state.

A stage keeps `wire_bytes: u32[]` in its state and adds to it, inside the branch that sends,
the bytes it put on the wire. The counter is cumulative modulo 2**32: the step builder reads
the difference between the counters after and before a step, which is exact in modular
arithmetic for any step that sends less than 4 GiB per device, and the training loop keeps
the running total as a Python int.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

COUNTER_FIELD = "wire_bytes"


def zero_bytes() -> jax.Array:
  """A fresh counter: u32[] zero.

  Example:
    >>> zero_bytes()
    Array(0, dtype=uint32)
  """
  return jnp.zeros((), jnp.uint32)


def add_bytes(counter: jax.Array, nbytes: float) -> jax.Array:
  """Adds a static byte count (rounded to whole bytes) to a counter.

  Example:
    >>> int(add_bytes(zero_bytes(), 1750.0))
    1750
  """
  return counter + jnp.uint32(int(round(nbytes)) % 2**32)


def counted_bytes(state: Any) -> jax.Array:
  """Sum (mod 2**32) of every `wire_bytes` field found anywhere in `state`.

  Counters are found by name, so nested and chained transforms all contribute.

  Example:
    >>> from typing import NamedTuple
    >>> class S(NamedTuple):  # any state with a `wire_bytes` field
    ...   wire_bytes: object
    >>> int(counted_bytes((S(add_bytes(zero_bytes(), 8)), [S(add_bytes(zero_bytes(), 4))])))
    12
  """
  total = zero_bytes()
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if any(getattr(k, "name", None) == COUNTER_FIELD for k in path):
      total = total + leaf.astype(jnp.uint32).reshape(-1)[0]
  return total
