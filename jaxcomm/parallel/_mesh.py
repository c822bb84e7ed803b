"""Meshes with named parallelism axes: replica, data, fsdp, tensor, sequence, pipeline."""

from __future__ import annotations

from typing import Mapping, Sequence

import jax

from jaxcomm import _validate as v
from jaxcomm.parallel import _validate

# What each axis means to jaxcomm's layouts:
#   replica   the slow axis between replicas of a (possibly sharded) model: the batch is
#             split over it and the communication method (sync / local) synchronises over
#             it; everything else runs inside a replica (see `Layout.optimizer`)
#   data      the batch is split over it; parameters replicated (or sharded by ZeRO-3 rules)
#   fsdp      the batch is split over it too, and the default rules shard parameters over it
#   tensor    Megatron tensor parallelism: heads and MLP columns split over it
#   sequence  the sequence is split over it (sequence-parallel attention)
#   pipeline  layers are split over it (pipeline stages)
#: The mesh axis names jaxcomm's layouts know, outermost first (see the comment above).
AXES = ("replica", "data", "fsdp", "tensor", "sequence", "pipeline")
#: The axes that split the batch.
BATCH_AXES = ("replica", "data", "fsdp")


def parse_mesh(text: str) -> dict:
  """Reads `"data=2,fsdp=2,tensor=2"` into `{"data": 2, "fsdp": 2, "tensor": 2}`.

  >>> parse_mesh("data=4,tensor=2")
  {'data': 4, 'tensor': 2}
  """
  if not isinstance(text, str):
    raise ValueError(f"mesh must be text like 'data=2,tensor=4', got {text!r}.")
  shape = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, eq, size = part.partition("=")
    name = name.strip()
    if not eq or not size.strip().isdigit():
      raise ValueError(f"mesh entry {part!r} must read axis=size, e.g. 'data=2,tensor=4'.")
    if name in shape:
      raise ValueError(f"mesh axis {name!r} appears twice in {text!r}.")
    shape[name] = v.integer(f"the size of mesh axis {name!r}", int(size), low=1)
  if not shape:
    raise ValueError(f"mesh {text!r} names no axis; allowed axes: {', '.join(AXES)}.")
  return shape


def make_mesh(shape: Mapping[str, int] | Sequence[int] | str,
              axis_names: Sequence[str] | None = None, devices=None) -> jax.sharding.Mesh:
  """A mesh with `AxisType.Auto` axes, e.g. `make_mesh({"data": 8})` (`jaxcomm.train` too).

  Auto axes give classic shard_map semantics (inputs are resharded to `in_specs`); the
  default Explicit axes of `jax.make_mesh` would require callers to pre-shard everything.
  Axes keep the order given, outermost first: put `replica` first (the slowest links) and
  `tensor` last so that its groups are neighbouring devices (the fastest links). The layouts
  read the axes in `AXES`; any other name is a plain axis for transforms and the Trainer.

  Args:
    shape: axis sizes, as a dict, as text like `"data=2,fsdp=2,tensor=2"`, or as a sequence
      of sizes with `axis_names`.
    axis_names: the names of a sequence `shape` (not with a dict or text).
    devices: the devices to use (all by default); the sizes must multiply to their number.

  Returns:
    A `jax.sharding.Mesh`.

  >>> dict(make_mesh("data=2,fsdp=2,tensor=2").shape)
  {'data': 2, 'fsdp': 2, 'tensor': 2}
  >>> dict(make_mesh({"data": 4, "tensor": 2}).shape), dict(make_mesh((8,), ("data",)).shape)
  ({'data': 4, 'tensor': 2}, {'data': 8})
  """
  if isinstance(shape, str):
    try:
      shape = parse_mesh(shape)
    except ValueError as e:
      raise ValueError(f"shape: {e}") from None
  if isinstance(shape, Mapping):
    shape = dict(shape)
  n = len(devices) if devices is not None else jax.device_count()
  shape, axis_names = _validate.mesh_shape(shape, axis_names, n)
  return jax.make_mesh(shape, axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                       devices=devices)
