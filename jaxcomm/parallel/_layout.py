"""A layout: a mesh, the rules that shard parameters over it, and how layers communicate."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
from jax.sharding import PartitionSpec as P

from jaxcomm import comm
from jaxcomm.parallel import _rules
from jaxcomm.parallel import _validate
from jaxcomm.parallel._mesh import BATCH_AXES


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a model is laid out on a mesh.

  The batch is split over the batch axes (`data`, `fsdp`) that the mesh has. Parameters are
  sharded by `rules` (logical names -> mesh axes, see `make_rules`): over `tensor` they are
  computed on in shards (Megatron tensor parallelism); over a batch axis (`fsdp` by default)
  they are stored in shards and gathered layer by layer (ZeRO-3 / FSDP, see `fsdp`).

  Attributes:
    mesh: the device mesh (see `make_mesh`).
    rules: the rules table (a dict or pairs; validated and stored as a tuple).
    sequence_parallel: Megatron sequence parallelism: between blocks the activations are
      split over `tensor` along the sequence, and each block's all-reduce becomes an
      all-gather before it and a reduce-scatter after it.
    collective_matmul: with sequence parallelism, overlap each block's all-gather with its
      first matmul through a ppermute loop (`matmul_allgather_overlapped`).

  >>> from jaxcomm.parallel import make_mesh
  >>> layout = Layout(make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
  >>> layout.batch_axes, layout.tensor_axis, layout.gather_axes
  (('data', 'fsdp'), 'tensor', ('fsdp',))
  """
  mesh: jax.sharding.Mesh
  rules: Any = _rules.DEFAULT_RULES
  sequence_parallel: bool = False
  collective_matmul: bool = False

  def __post_init__(self):
    _validate.mesh(self.mesh)
    _validate.flag("sequence_parallel", self.sequence_parallel)
    _validate.flag("collective_matmul", self.collective_matmul)
    object.__setattr__(self, "rules", _rules.make_rules(self.rules))
    if "batch" not in dict(self.rules):  # every model and the Trainer split the batch by it
      raise ValueError(f"rules must map the logical axis 'batch' (a table replaces the "
                       f"defaults; change single entries with make_rules(**overrides)); the "
                       f"rules cover {sorted(dict(self.rules))}.")
    if self.sequence_parallel and self.tensor_axis is None:
      raise ValueError("sequence_parallel needs a mesh with a 'tensor' axis of size > 1; "
                       f"the mesh is {dict(self.mesh.shape)}.")
    if self.collective_matmul and not self.sequence_parallel:
      raise ValueError("collective_matmul overlaps the sequence-parallel all-gather: it "
                       "needs sequence_parallel=True.")

  def size(self, axis: str | Sequence[str] | None) -> int:
    """Devices along a mesh axis or tuple of axes (1 for absent axes and None)."""
    shape = dict(self.mesh.shape)
    axes = comm.axis_names(axis)
    return math.prod(shape.get(a, 1) for a in axes)

  @property
  def batch_axes(self) -> tuple:
    """Mesh axes the batch is split over (the Trainer's `axis_name`)."""
    return tuple(a for a in self.mesh.axis_names if a in BATCH_AXES)

  @property
  def tensor_axis(self) -> str | None:
    """'tensor' when the mesh splits layers over it, else None."""
    return "tensor" if self.size("tensor") > 1 else None

  @property
  def gather_axes(self) -> tuple:
    """Batch axes that the rules store parameters sharded over (gathered per layer)."""
    param_axes = {a for name, v in self.rules if name != "batch"
                  for a in comm.axis_names(v)}
    return tuple(a for a in self.batch_axes if a in param_axes and self.size(a) > 1)

  @property
  def batch_spec(self) -> P:
    return P(self.batch_axes or None)

  def spec(self, logical: Sequence[str | None], shape: Sequence[int] | None = None) -> P:
    """PartitionSpec of one array from the logical names of its dimensions."""
    return _rules.logical_to_spec(logical, self.rules, dict(self.mesh.shape), shape)

  def param_specs(self, logical_axes: Any, params: Any = None, **kwargs) -> Any:
    """PartitionSpecs of a parameter tree (see `jaxcomm.parallel.param_specs`)."""
    return _rules.param_specs(logical_axes, self.rules, self.mesh, params, **kwargs)

  def local_shape(self, shape: Sequence[int], logical: Sequence[str | None]) -> tuple:
    """Shape of one device's shard of an array with these logical dimension names."""
    spec = self.spec(logical, shape)
    return tuple(n // self.size(entry) for n, entry in zip(shape, tuple(spec) +
                                                           (None,) * (len(shape) - len(spec))))
