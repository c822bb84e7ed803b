"""The checks behind `jaxcomm.train`'s public API (built on `jaxcomm._validate`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxcomm import _validate as v


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


def trainer_axes(axis_name: Any, mesh: Any) -> tuple:
  """The data axes of a Trainer as a tuple: at least one, all in the mesh."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh (see make_mesh), got {mesh!r}.")
  if axis_name is None or axis_name == ():
    raise ValueError("axis_name must name at least one mesh axis; for one device use a "
                     "mesh of size 1 or call the transform directly.")
  axis_name = v.axis_name("axis_name", axis_name, allow_none=False)
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if any(a not in mesh.axis_names for a in axes):
    raise ValueError(f"axis_name {axis_name!r} is not in the mesh; allowed axis names: "
                     f"{tuple(mesh.axis_names)}.")
  return axes


def trainer_args(loss_fn: Any, optimizer: Any) -> None:
  v.callable_("loss_fn", loss_fn)
  v.transform("optimizer", optimizer)


def batch(tree: Any, num_workers: int, axis_name: Any) -> None:
  """Every leaf of a global batch has a leading dimension divisible by the workers."""
  for x in jax.tree.leaves(tree):
    n = np.shape(x)[0] if np.ndim(x) else None
    if n is None or n % num_workers:
      raise ValueError(f"the global batch size ({n}) must be divisible by the data axis "
                       f"size {num_workers} (axis_name={axis_name!r}).")


def fit_args(steps: Any, log_every: Any) -> None:
  v.integer("steps", steps, low=0)
  v.integer("log_every", log_every, low=1)


def checkpoint_args(directory: Any, every: Any, keep: Any) -> tuple[str, int, int]:
  if not isinstance(directory, str) or not directory:
    raise ValueError(f"directory must be a non-empty path string, got {directory!r}.")
  return directory, v.integer("every", every, low=1), v.integer("keep", keep, low=1)


def distributed_args(coordinator: Any, num_processes: Any, process_id: Any,
                     **timeouts_s: Any) -> None:
  """A coordinator 'host:port' with the process count and this process's id (or none)."""
  for name, value in timeouts_s.items():
    v.integer(name, value, low=1)
  if coordinator is None:
    if num_processes is not None or process_id is not None:
      raise ValueError("num_processes and process_id need a coordinator ('host:port').")
    return
  host, _, port = coordinator.rpartition(":") if isinstance(coordinator, str) else ("", "", "")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"coordinator must be 'host:port' (e.g. '10.0.0.1:1234'), "
                     f"got {coordinator!r}.")
  num_processes = v.integer("num_processes", num_processes, low=1)
  v.integer("process_id", process_id, low=0, high=num_processes - 1)
