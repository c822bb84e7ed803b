"""What the step is a function of (`StepConfig`) and the train state's layout (`StateLayout`).

Replicated or per-worker, by construction. A leaf of the train state is *per-worker* when the
transform makes it differ between devices that its PartitionSpec says hold the same value
(error memories, local momenta, DiLoCo worker parameters). `derive_layout` finds out which
leaves those are, and over which mesh axes they differ, by tracing the transform under
`shard_map` on abstract shapes and reading each output's varying manual axes (the same types
that shard_map's check uses): starting from `init`, it traces `update` with a local (varying)
gradient until the sets of varying axes stop growing. A per-worker leaf is stored with a
leading axis over exactly the mesh axes it differs over and its spec does not shard it over:
a replica's state inside a `replica x fsdp x tensor` mesh is stored once per replica (leading
axis over `replica`), sharded like the parameters inside the replica. Replicated leaves are
stored once. With `trials`, an unsharded trial axis comes first, before the worker axis.
The layout is computed once, from shapes, and is frozen: the step is built from it
(`make_step`) and nothing is discovered while the real step is traced.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.train import _validate

MUTABLE = ("per_worker", "mean")


@dataclasses.dataclass(frozen=True, eq=False)
class StepConfig:
  """Everything the train step is a function of, fixed when it is built (validated here).

  The arguments of `Trainer` (see there), with the batch axes as a tuple `batch_axes` (a
  single name is accepted) and `nnx`, the `_nnx.Parts` of an NNX model (None for a parameter
  tree). `key` is kept typed (one key, or one per trial with `trials`).

  >>> import jax.numpy as jnp, optax
  >>> from jaxcomm import sync
  >>> from jaxcomm.parallel import make_mesh
  >>> config = StepConfig(lambda p, b: jnp.mean((b * p["w"]) ** 2),
  ...                     optax.chain(sync.mean("data"), optax.sgd(0.1)),
  ...                     make_mesh({"data": 8}), batch_axes="data")
  >>> config.batch_axes, config.num_workers
  (('data',), 8)
  """
  loss_fn: Callable
  optimizer: optax.GradientTransformation
  mesh: jax.sharding.Mesh
  batch_axes: Any = ("data",)
  param_specs: Any = None
  has_aux: bool = False
  batch_specs: Any = None
  key: jax.Array | None = None
  mutable: str = "per_worker"
  donate: bool = True
  trials: int | None = None
  nnx: Any = None

  def __post_init__(self):
    fix = functools.partial(object.__setattr__, self)  # normalised values of a frozen class
    fix("batch_axes", _validate.batch_axes(self.batch_axes, self.mesh))
    v.callable_("loss_fn", self.loss_fn)
    v.transform("optimizer", self.optimizer)
    fix("trials", _validate.trials(self.trials))
    fix("mutable", v.one_of("mutable", self.mutable, MUTABLE))
    fix("donate", v.flag("donate", self.donate))
    if self.key is not None:  # typed, for fold_in; None: the loss takes no key
      fix("key", jax.random.wrap_key_data(v.key("key", self.key)) if self.trials is None
          else _validate.trial_keys(self.key, self.trials))

  @property
  def num_workers(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.batch_axes)

  @property
  def extra_axes(self) -> tuple:
    """The mesh axes that are not batch axes (tensor, pipeline, ...), in mesh order."""
    return tuple(a for a in self.mesh.axis_names if a not in self.batch_axes)

  def lead_axes(self, per_worker) -> tuple:
    """The mesh axes (mesh order) of a per-worker leaf's leading axis; () if replicated."""
    return tuple(a for a in self.mesh.axis_names if a in per_worker) if per_worker else ()

  def stored(self, per_worker, base_specs):
    """Specs of stored leaves: worker axes in front of per-worker leaves, then trials."""
    specs = jax.tree.map(lambda pw, s: P(self.lead_axes(pw), *s) if pw else s,
                         per_worker, base_specs)
    return self.with_trials(specs)

  def with_trials(self, specs):
    """With trials, an unsharded leading trial axis in front of every spec."""
    if self.trials is None:
      return specs
    return jax.tree.map(lambda s: P(None, *s), specs, is_leaf=lambda x: isinstance(x, P))

  def one_trial(self, tree):
    """Abstract shapes of one trial's leaves (the leading trial axis removed)."""
    cut = 0 if self.trials is None else 1
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[cut:], jnp.result_type(x)),
                        tree)

  def batch_specs_for(self, batch) -> Any:
    """PartitionSpecs of a global batch: the leading dimension over the batch axes by default.

    `batch=None` gives a prefix of any batch's specs (one spec for every leaf, unless
    `batch_specs` is a tree): what the step's `in_specs` need before a batch is seen.
    """
    if self.batch_specs is not None and not isinstance(self.batch_specs, P):
      specs = self.batch_specs
    else:
      spec = P(self.batch_axes) if self.batch_specs is None else self.batch_specs
      specs = spec if batch is None else jax.tree.map(lambda _: spec, batch)
    return self.with_trials(specs)


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """The train state's layout: which leaves are per-worker, their specs, the norm groups.

  `params`, `opt_state`, `model_state`: trees like the state whose leaves are frozensets of
  mesh axis names: the axes a leaf differs over that its spec does not shard it over
  (empty: replicated; truthy when per-worker). Such a leaf is stored with a leading axis
  over those axes (mesh order). `param_specs`, `opt_specs`, `model_specs`: the specs of one
  trial's leaves over the mesh before that leading axis. `grad_groups`: the non-data axes
  the gradient leaves vary over, one group per set (sorted); the step reports a squared
  gradient norm per group, summed over its axes when measured.
  """
  params: Any
  opt_state: Any
  model_state: Any = None
  param_specs: Any = None
  opt_specs: Any = None
  model_specs: Any = None
  grad_groups: tuple = ((),)


def _free_axes(mesh, spec) -> frozenset:
  """Mesh axes over which a leaf with this base spec can differ without being sharded."""
  return frozenset(mesh.axis_names) - {a for entry in spec for a in comm.axis_names(entry)}


def _resize(mesh, shape, spec, grow: bool) -> tuple:
  """Global shape from a local one (grow) or the reverse, for a leaf with this spec."""
  sizes = [math.prod(mesh.shape[a] for a in comm.axis_names(e)) for e in spec]
  sizes += [1] * (len(shape) - len(sizes))
  return tuple(n * k if grow else n // k for n, k in zip(shape, sizes))


def _opt_specs(config, opt_local, params_abs, pspecs):
  """Optimiser-state leaves shaped like a parameter (adam's mu, nu, ...) are sharded like it.

  A leaf matches a parameter when the parameter's tree path is a suffix of the leaf's path
  and their local shapes agree; every other leaf is replicated over non-data axes.
  """
  if config.param_specs is None:
    return jax.tree.map(lambda _: P(), opt_local)
  flat, _ = jax.tree_util.tree_flatten_with_path(params_abs)
  specs = jax.tree.leaves(pspecs, is_leaf=lambda x: isinstance(x, P))
  entries = [(tuple(path), _resize(config.mesh, x.shape, spec, grow=False), spec)
             for (path, x), spec in zip(flat, specs)]

  def spec_for(path, x):
    path = tuple(path)
    for ppath, shape, spec in entries:
      if len(ppath) <= len(path) and path[len(path) - len(ppath):] == ppath and \
         tuple(x.shape) == shape:
        return spec
    return P()

  return jax.tree_util.tree_map_with_path(spec_for, opt_local)


def unstack(tree, per_worker):
  """One worker's view inside the step: the leading axis of per-worker leaves dropped."""
  return jax.tree.map(lambda pw, x: x[0] if pw else x, per_worker, tree)


def stack(tree, per_worker):  # the reverse of `unstack`
  return jax.tree.map(lambda pw, x: x[None] if pw else x, per_worker, tree)


def _stacked(config: StepConfig, abstract: Any, per_worker: Any) -> Any:
  """Global shapes of stored leaves: a leading axis over the workers of per-worker ones."""
  def one(pw, x):
    if not pw:
      return x
    size = math.prod(config.mesh.shape[a] for a in config.lead_axes(pw))
    return jax.ShapeDtypeStruct((size, *x.shape), x.dtype)
  return jax.tree.map(one, per_worker, abstract)


def derive_layout(config: StepConfig, abstract_params: Any,
                  abstract_model_state: Any = None) -> StateLayout:
  """The frozen layout of the train state, from the parameters' shapes (nothing is run).

  The fixed point of "over which axes does each leaf vary" under `init` and `update`.
  `init` is traced under shard_map, so an optimiser state whose shapes depend on the axis
  sizes (a 1/W shard, ZeRO) works; probes stack every leaf over all mesh axes so that any
  leaf passes shard_map's check. A leaf is per-worker over the mesh axes it varies over that
  its spec does not shard it over. An NNX model's variables that the forward pass updates
  are per-worker over the batch axes with `mutable="per_worker"`.

  Args:
    config: the step's configuration.
    abstract_params: the parameters `make_init` takes (arrays or ShapeDtypeStructs; with
      `config.trials`, with their leading trial axis).
    abstract_model_state: an NNX model's other variables (None for a parameter tree).

  Returns:
    A `StateLayout`.

  >>> import jax, jax.numpy as jnp, optax
  >>> from jaxcomm import local
  >>> from jaxcomm.parallel import make_mesh
  >>> config = StepConfig(lambda p, b: jnp.mean((b * p["w"]) ** 2),
  ...                     local.local_sgd(optax.sgd(0.1), 2), make_mesh({"data": 8}))
  >>> layout = derive_layout(config, {"w": jax.ShapeDtypeStruct((3,), jnp.float32)})
  >>> sorted(layout.params["w"])  # local SGD: each worker keeps its own parameters
  ['data']
  """
  mesh = config.mesh
  params_abs = config.one_trial(abstract_params)
  pspecs = config.param_specs
  if pspecs is None:
    pspecs = jax.tree.map(lambda _: P(), params_abs)
  found = {}
  every = P(tuple(mesh.axis_names))

  def record(key, tree, specs):
    found[key] = jax.tree.map(lambda x, spec: _free_axes(mesh, spec) & comm.varying_axes(x),
                              tree, specs)

  def probe_init(p):
    opt = config.optimizer.init(p)
    found["opt_local"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), opt)
    found["opt_vary"] = jax.tree.map(comm.varying_axes, opt)
    return jax.tree.map(lambda x: x[None], opt)

  jax.eval_shape(jax.shard_map(probe_init, mesh=mesh, in_specs=(pspecs,), out_specs=every),
                 params_abs)
  opt_specs = _opt_specs(config, found["opt_local"], params_abs, pspecs)
  opt_abs = jax.tree.map(
      lambda x, spec: jax.ShapeDtypeStruct(_resize(mesh, x.shape, spec, grow=True), x.dtype),
      found["opt_local"], opt_specs)
  per_worker = (jax.tree.map(lambda _: frozenset(), params_abs),
                jax.tree.map(lambda vary, spec: _free_axes(mesh, spec) & vary,
                             found.pop("opt_vary"), opt_specs))
  for _ in range(8):
    def probe_update(p, o, pw=per_worker):
      p, o = unstack(p, pw[0]), unstack(o, pw[1])
      grads = comm.varying(jax.tree.map(jnp.zeros_like, p), config.batch_axes)
      found["groups"] = tuple(sorted({
          tuple(a for a in config.extra_axes if a in comm.varying_axes(g))
          for g in jax.tree.leaves(grads)}))
      updates, o = config.optimizer.update(grads, o, p)
      p = optax.apply_updates(p, updates)
      record("params", p, pspecs)
      record("opt", o, opt_specs)
      return jax.tree.map(lambda x: x[None], (p, o))

    in_specs = tuple(jax.tree.map(lambda w, s: P(config.lead_axes(w), *s) if w else s, w, s)
                     for w, s in zip(per_worker, (pspecs, opt_specs)))
    jax.eval_shape(jax.shard_map(probe_update, mesh=mesh, in_specs=in_specs, out_specs=every),
                   _stacked(config, params_abs, per_worker[0]),
                   _stacked(config, opt_abs, per_worker[1]))
    new = tuple(jax.tree.map(lambda a, b: a | b, old, found[key])
                for old, key in zip(per_worker, ("params", "opt")))
    if all(jax.tree.leaves(a) == jax.tree.leaves(b) for a, b in zip(new, per_worker)):
      _validate.params_layout(new[0], pspecs, config.batch_axes)
      return StateLayout(params=new[0], opt_state=new[1],
                         **_model_layout(config, abstract_model_state),
                         param_specs=pspecs, opt_specs=opt_specs, grad_groups=found["groups"])
    per_worker = new
  raise RuntimeError("the per-worker layout of the train state did not settle.")


def _model_layout(config: StepConfig, abstract_model_state: Any) -> dict:
  """An NNX model's other variables: per worker (the ones the forward pass updates) or not."""
  if abstract_model_state is None:
    return {}
  if config.nnx is None:
    raise ValueError("abstract_model_state is an NNX model's other variables: it needs "
                     "config.nnx (the model's parts); pass None for a parameter tree.")
  variables = config.nnx.is_variable()
  per_worker = jax.tree.map(
      lambda var: frozenset(config.batch_axes) if var and config.mutable == "per_worker"
      else frozenset(), variables)
  return {"model_state": per_worker, "model_specs": jax.tree.map(lambda _: P(), variables)}

