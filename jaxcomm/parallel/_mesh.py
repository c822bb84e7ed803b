"""Meshes with named parallelism axes: data, fsdp, tensor, sequence, pipeline."""

from __future__ import annotations

from typing import Mapping

import jax

from jaxcomm import train

# What each axis means to jaxcomm's layouts:
#   data      the batch is split over it; parameters replicated (or sharded by ZeRO-3 rules)
#   fsdp      the batch is split over it too, and the default rules shard parameters over it
#   tensor    Megatron tensor parallelism: heads and MLP columns split over it
#   sequence  the sequence is split over it (sequence-parallel attention)
#   pipeline  layers are split over it (pipeline stages)
AXES = ("data", "fsdp", "tensor", "sequence", "pipeline")
BATCH_AXES = ("data", "fsdp")


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
    shape[name] = int(size)
  if not shape:
    raise ValueError(f"mesh {text!r} names no axis; allowed axes: {', '.join(AXES)}.")
  return shape


def make_mesh(shape: Mapping[str, int] | str, devices=None) -> jax.sharding.Mesh:
  """A mesh over any of the axes `data, fsdp, tensor, sequence, pipeline` (Auto axis types).

  Axes keep the order given, outermost first: put `tensor` last so that its groups are
  neighbouring devices (the fastest links). Built by `jaxcomm.train.make_mesh`.

  Args:
    shape: axis sizes, as a dict or as text like `"data=2,fsdp=2,tensor=2"`.
    devices: the devices to use (all by default); the sizes must multiply to their number.

  Returns:
    A `jax.sharding.Mesh`.

  >>> dict(make_mesh("data=2,fsdp=2,tensor=2").shape)
  {'data': 2, 'fsdp': 2, 'tensor': 2}
  """
  if isinstance(shape, str):
    try:
      shape = parse_mesh(shape)
    except ValueError as e:
      raise ValueError(f"shape: {e}") from None
  if not isinstance(shape, Mapping):
    raise ValueError(f"shape must be a dict {{axis: size}} or text like 'data=2,tensor=4', "
                     f"got {shape!r}.")
  unknown = [a for a in shape if a not in AXES]
  if unknown:
    raise ValueError(f"shape: mesh axis names {unknown} are unknown; allowed: "
                     f"{', '.join(AXES)}.")
  return train.make_mesh(dict(shape), devices=devices)
