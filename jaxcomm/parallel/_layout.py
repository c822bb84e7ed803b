"""A layout: a mesh, the rules that shard parameters over it, and how layers communicate."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
from jax.sharding import PartitionSpec as P

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.parallel import _by_sharding
from jaxcomm.parallel import _rules
from jaxcomm.parallel import _zero
from jaxcomm.parallel._mesh import BATCH_AXES


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a model is laid out on a mesh.

  The batch is split over the batch axes (`replica`, `data`, `fsdp`) that the mesh has.
  Parameters are sharded by `rules` (logical names -> mesh axes, see `make_rules`): over
  `tensor` they are computed on in shards (Megatron tensor parallelism); over a batch axis
  (`fsdp` by default) they are stored in shards and gathered layer by layer (ZeRO-3 / FSDP,
  see `fsdp`).

  Replicas: the communication method (a `jaxcomm.sync` or `jaxcomm.local` transform)
  synchronises over `replica_axis` (the mesh's `replica` axis, or without one the batch axes
  the parameters are not sharded over, e.g. `data`); ZeRO-3 and tensor parallelism run
  inside each replica (`inner_axes`, `tensor`). `optimizer` puts the two together.

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
  >>> replicas = Layout(make_mesh("replica=2,fsdp=2,tensor=2"))
  >>> replicas.batch_axes, replicas.replica_axis, replicas.inner_axes
  (('replica', 'fsdp'), 'replica', ('fsdp',))
  """
  mesh: jax.sharding.Mesh
  rules: Any = _rules.DEFAULT_RULES
  sequence_parallel: bool = False
  collective_matmul: bool = False

  def __post_init__(self):
    v.mesh("mesh", self.mesh)
    v.flag("sequence_parallel", self.sequence_parallel)
    v.flag("collective_matmul", self.collective_matmul)
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
    """Mesh axes the batch is split over (the Trainer's and StepConfig's `batch_axes`)."""
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
  def replica_axis(self) -> str | tuple | None:
    """The axis name a communication method synchronises over (None: nothing to sync).

    The `replica` axis when the mesh has one and the rules do not shard parameters over it;
    otherwise the batch axes the parameters are not sharded over (`data` in a
    `data x fsdp x tensor` mesh). A single axis is returned as a string.
    """
    free = tuple(a for a in self.batch_axes if a not in self.gather_axes)
    axes = ("replica",) if "replica" in free else free
    return None if not axes else axes[0] if len(axes) == 1 else axes

  @property
  def inner_axes(self) -> tuple:
    """Batch axes inside a replica (`data`, `fsdp`): reduced exactly every step by ZeRO-3."""
    method = comm.axis_names(self.replica_axis)
    return tuple(a for a in self.batch_axes if a not in method)

  def optimizer(self, method, param_specs: Any, regather: Any = None):
    """The transform that trains a laid-out model with a communication method over replicas.

    Every step the gradient is first reduced exactly inside the replica: ZeRO-3
    (`zero(stage=3)`) over `inner_axes` finishes the FSDP reduce-scatter of the sharded
    parameters and averages the others over `data`. Only then does `method` see it: one
    gradient per replica, sharded like the parameters, so that a method over `replica_axis`
    (DiLoCo, PowerSGD, a codec with error feedback) runs as it would on unsharded replicas
    and its state (outer parameters, error memories) is stored sharded like the parameters.
    `method` runs once per group of equally sharded leaves (`by_sharding`), so a flat
    vector of every leaf (a codec's) never makes a replicated parameter differ over
    `tensor` or `fsdp`.

    Args:
      method: an optax transform that synchronises over `replica_axis` and includes the
        optimiser, e.g. `optax.chain(sync.powersgd(2, axis_name="replica",
        param_specs=specs), optax.adamw(1e-3))` or `local.diloco(optax.adamw(1e-3), outer,
        sync_every=50, axis_name="replica")`.
      param_specs: the parameters' PartitionSpecs (`Layout.param_specs`).
      regather: the model's `param_regather()` (counts FSDP's backward gathers).

    Returns:
      An `optax.GradientTransformationExtraArgs` for `Trainer(..., batch_axes=batch_axes,
      param_specs=param_specs)`.

    >>> import jax, jax.numpy as jnp, optax
    >>> from jaxcomm import local, models, train
    >>> from jaxcomm.parallel import make_mesh
    >>> layout = Layout(make_mesh("replica=2,fsdp=2,tensor=2"))
    >>> lm = models.TransformerLM(d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=8,
    ...                           layout=layout)
    >>> params = models.TransformerLM(d_model=16, num_layers=1, num_heads=2, d_ff=32,
    ...                               max_len=8).init(jax.random.key(0), jnp.zeros((1, 8), int))
    >>> specs = layout.param_specs(lm.param_axes(), params)
    >>> method = local.diloco(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True),
    ...                       sync_every=2, axis_name=layout.replica_axis)
    >>> trainer = train.Trainer(models.lm_loss(lm),
    ...                         layout.optimizer(method, specs, lm.param_regather()),
    ...                         layout.mesh, batch_axes=layout.batch_axes, param_specs=specs)
    >>> state = trainer.init(params)
    >>> outer = state.opt_state.inner_state.inner_states["fsdp"].inner_state.outer_params
    >>> outer["params"]["head"]["kernel"].sharding.spec  # shared by replicas, sharded
    P('fsdp',)
    >>> state.params["params"]["head"]["kernel"].sharding.spec  # one copy per replica
    P('replica', 'fsdp')
    """
    method = _by_sharding.by_sharding(method, param_specs)
    if not self.inner_axes:
      return method
    axis = self.inner_axes[0] if len(self.inner_axes) == 1 else self.inner_axes
    return _zero.zero(method, stage=3, axis_name=axis, param_specs=param_specs, regather=regather)

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
