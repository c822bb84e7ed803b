"""Shape-aware codecs, and the checks every transform that takes a codec makes.

A transform flattens a parameter tree into one float32 vector and a codec sees only that
vector. A per-tensor codec (DeMo's 2-D DCT tiles, top-k per row of a matrix) needs the
tensors' shapes, so wherever a transform takes a codec it also takes a *factory*: a callable
`shapes -> Codec`, called with the tree's leaf shapes in flat-vector order when the
transform first meets the tree (`for_tree`). A codec made for a tree's shapes, like any
codec with a `length`, needs the whole vector: collectives that would split the vector into
chunks refuse it (`splittable`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Union

import jax
import jax.numpy as jnp

from jaxcomm.codecs._base import Codec

#: What a transform's `codec` argument may be: a codec, or a factory from the leaf shapes.
CodecLike = Union[Codec, Callable[[list], Codec]]


def validate(value: Any, name: str = "codec", *, allow_none: bool = False) -> Any:
  """A `Codec` or a factory `shapes -> Codec` (any other callable), else a ValueError.

  Args:
    value: what the caller passed.
    name: the argument's name, for the message.
    allow_none: whether None (no codec) is allowed.

  Returns:
    `value` unchanged.

  >>> from jaxcomm import codecs
  >>> validate(codecs.sign()).name
  'sign(block=None)'
  """
  if value is None and allow_none:
    return None
  if isinstance(value, Codec) or (callable(value) and not isinstance(value, (str, type))
                                  and _takes_one_argument(value)):
    return value
  none = " or None" if allow_none else ""
  raise ValueError(f"{name} must be a jaxcomm.codecs.Codec (e.g. codecs.top_k(0.01)) or a "
                   f"factory from the parameter shapes to a Codec{none}, got {value!r}.")


def _takes_one_argument(fn: Callable) -> bool:
  """Whether `fn(shapes)` binds (True when Python cannot tell, as for some builtins)."""
  try:
    inspect.signature(fn).bind([])
  except TypeError:
    return False
  except ValueError:
    return True
  return True


def splittable(codec: CodecLike) -> bool:
  """Whether a collective may cut the vector into chunks and encode each on its own.

  Two-phase all-reduces, hierarchical axes and ZeRO's reduce-scatter encode 1/W chunks. A
  codec with a `length` (built for one vector) or one made by a factory (built for the
  tensors' shapes) needs the whole vector.

  >>> from jaxcomm import codecs
  >>> splittable(codecs.sign()), splittable(codecs.tiled_dct_top_k([(4, 4)], 4, 2))
  (True, False)
  """
  return isinstance(codec, Codec) and codec.length is None


def payload_spec(codec: Codec, n: int) -> tuple:
  """The payload's shapes and dtypes for n elements (traced with `jax.eval_shape`).

  A codec without `stochastic=True` is encoded with key=None; one that draws random
  numbers anyway fails inside `jax.random` with a TypeError, which this turns into a
  ValueError that names the flag.

  Args:
    codec: a `Codec`.
    n: the vector length.

  Returns:
    The payload as a tuple of `jax.ShapeDtypeStruct`s.

  >>> from jaxcomm import codecs
  >>> [(x.shape, x.dtype.name) for x in payload_spec(codecs.sign(), 20)]
  [((3,), 'uint8'), ((1,), 'float32')]
  """
  def encode(x):
    return codec.encode(x, jax.random.key(0) if codec.stochastic else None)

  try:
    return jax.eval_shape(encode, jax.ShapeDtypeStruct((n,), jnp.float32))
  except TypeError as e:
    # jax.random says "unexpected PRNG key type NoneType"; indexing None says "NoneType".
    if codec.stochastic or not any(w in str(e) for w in ("PRNG key", "NoneType")):
      raise
    raise ValueError(
        f"codec {codec.name!r} is not stochastic, so its encode is called with key=None, and "
        f"encode raised TypeError: {e}. If encode draws random numbers, build the Codec with "
        f"stochastic=True (the transform then passes it a PRNG key).") from e


def _brief(shapes: list) -> str:
  return f"[{', '.join(map(str, shapes[:4]))}{', ...' if len(shapes) > 4 else ''}]"


def for_tree(codec: CodecLike, tree: Any) -> Codec:
  """The codec that encodes `tree`'s flat vector (`flatten(tree)`).

  A `Codec` is returned as is (its `length`, if set, must be the tree's size); a factory is
  called with the leaf shapes in flat-vector order, and the codec it makes needs the whole
  vector (its `length` is the tree's size). Either way the payload is traced once
  (`payload_spec`), so a codec that breaks its flags fails here, before any step.

  Args:
    codec: a `Codec` or a factory `shapes -> Codec`.
    tree: the tree the transform encodes (arrays or `jax.ShapeDtypeStruct`s).

  Returns:
    A `Codec` for vectors of the tree's size.

  >>> import functools, jax.numpy as jnp
  >>> from jaxcomm import codecs
  >>> tree = {"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)}
  >>> c = for_tree(functools.partial(codecs.tiled_dct_top_k, chunk=4, k=2), tree)
  >>> c.length, c.payload_bytes(72)  # 4 tiles of 4 x 4 and 2 chunks of 4, 2 pairs each
  (72, 60)
  """
  validate(codec)
  shapes = [tuple(jnp.shape(x)) for x in jax.tree.leaves(tree)]
  n = sum(math.prod(s) for s in shapes)
  if not isinstance(codec, Codec):
    try:
      made = codec(shapes)
    except (TypeError, ValueError) as e:
      raise ValueError(f"the codec factory {codec!r}, called with the leaf shapes "
                       f"{_brief(shapes)}, raised {type(e).__name__}: {e} (a factory takes the "
                       f"shapes and returns a Codec; pass codecs.top_k(0.01), not "
                       f"codecs.top_k).") from e
    if not isinstance(made, Codec):
      raise ValueError(f"the codec factory {codec!r} must return a jaxcomm.codecs.Codec for "
                       f"the shapes {_brief(shapes)}, got {made!r}.")
    codec = made if made.length is not None else dataclasses.replace(made, length=n)
  if codec.length is not None and codec.length != n:
    raise ValueError(f"codec {codec.name!r} was built for vectors of {codec.length} elements, "
                     f"but the tree it encodes has {n}.")
  payload_spec(codec, n)
  return codec
