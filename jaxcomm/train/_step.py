"""The train state and the step builder: a user loss and an optax transform on a mesh.

Replicated or per-worker, by construction. A leaf of the train state is
*per-worker* when the transform makes it differ between devices that its PartitionSpec says
hold the same value (error memories, local momenta, DiLoCo worker parameters). The builder
finds out which leaves those are, and over which mesh axes they differ, by tracing the
transform under `shard_map` and reading each output's varying manual axes (the same types
that shard_map's check uses): starting from `init`, it traces `update` with a local
(varying) gradient until the sets of varying axes stop growing. A per-worker leaf is stored
with a leading axis over exactly the mesh axes it differs over and its spec does not shard
it over: a replica's state inside a `replica x fsdp x tensor` mesh is stored once per
replica (leading axis over `replica`), sharded like the parameters inside the replica.
Replicated leaves are stored once. Nothing per-worker is averaged or dropped at a step
boundary.

The step donates the train state (`donate_argnums`): the new state takes the old one's
buffers, so a model-sized state (DiLoCo's outer parameters, error memories) is not held
twice at the step's peak. A state passed to `step` is consumed; keep the returned one.

Meshes are built with `AxisType.Auto` axes (see `jaxcomm.parallel.make_mesh`): the classic
shard_map model, in which inputs are resharded to `in_specs` as needed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm import sync
from jaxcomm.train import _nnx
from jaxcomm.train import _validate

MUTABLE = ("per_worker", "mean")


class TrainState(NamedTuple):
  """Everything a run needs to continue: one Orbax save restores it exactly."""
  step: jax.Array   # i32[]: optimiser steps taken
  params: Any       # parameters; per-worker leaves carry a leading worker axis
  opt_state: Any    # optimiser state; per-worker leaves carry a leading worker axis
  # An NNX model's other variables (BatchNorm statistics, RNG stream keys) as a pure dict;
  # per-worker leaves carry a leading worker axis. None for a parameter tree.
  model_state: Any = None


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Which leaves of the train state are per-worker, and over which mesh axes.

  Trees like params/opt_state whose leaves are frozensets of mesh axis names: the axes a
  leaf differs over that its spec does not shard it over (empty: replicated; truthy when
  per-worker). Such a leaf is stored with a leading axis over those axes (mesh order).
  """
  params: Any
  opt_state: Any
  model_state: Any = None


class Trainer:
  """Builds and runs a data-parallel training step with any optax transform.

  The loss is `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux=True`),
  computed on one worker's share of the batch. Inside the step each worker differentiates
  with respect to its own copy of the parameters, so the transform receives the *local*
  gradient and decides what travels (`jaxcomm.sync.mean` for exact data parallelism).

  Args:
    loss_fn: the per-worker loss.
    optimizer: an `optax.GradientTransformation` (e.g. `optax.chain(sync.mean("data"),
      optax.adamw(1e-3))`).
    mesh: the device mesh (see `jaxcomm.parallel.make_mesh`).
    axis_name: the data axis (or tuple of axes) the batch is split over.
    param_specs: optional PartitionSpecs of the parameters (tensor-parallel shards and
      pipeline stages over non-data axes, ZeRO-3 shards over a data axis); replicated by
      default. Optimiser-state leaves that mirror a parameter (same tree path suffix and
      shard shape: Adam's mu and nu, ...) get its spec.
    has_aux: whether `loss_fn` returns `(loss, aux)`; aux leaves are reported per worker.
    batch_specs: optional PartitionSpecs of the batch leaves (e.g. `P("data", "sequence")`
      for tokens split over a sequence axis); by default the leading dimension is split
      over the data axes.
    key: opt in to randomness in the loss: a PRNG key (`jax.random.key(seed)`); the loss is
      then called `loss_fn(params, batch, key)` with `step_key(key, step, worker)`, a key
      per step and worker (a pure function of them, so a resumed run draws the same).
    mutable: how an NNX model's mutable variables (BatchNorm statistics) are kept:
      "per_worker" (default: each worker's from its own batches, stored with a leading
      worker axis; nothing is sent) or "mean" (averaged over the data axes after every
      step, replicated; the all-reduce is counted in `wire_bytes`).
    donate: donate the train state to the step (its buffers are reused for the new state;
      the state passed to `step` is then consumed). True by default.

  NNX models: `init(model)` takes an `nnx.Module` and the loss is then
  `loss_fn(model, batch)` (plus `key` when given). The parameters (`nnx.Param`) become a
  plain dict, what the optimiser and the collectives see (laid out like a linen model's);
  the other variables become `TrainState.model_state`; RNG streams are reseeded every step
  with `step_key(stream key, step, worker)` (see `jaxcomm.train._nnx`). `model(state)`
  gives the trained model back.

  >>> import jax.numpy as jnp, optax
  >>> from jaxcomm import sync
  >>> from jaxcomm.parallel import make_mesh
  >>> mesh = make_mesh({"data": 8})
  >>> loss = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
  >>> trainer = Trainer(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh)
  >>> state = trainer.init({"w": jnp.zeros(())})
  >>> batch = {"x": jnp.ones(16), "y": 2 * jnp.ones(16)}
  >>> state, m = trainer.step(state, batch)
  >>> float(state.params["w"]), int(m["wire_bytes"])
  (0.4000000059604645, 7)
  """

  def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation,
               mesh: jax.sharding.Mesh, *, axis_name: str | tuple = "data",
               param_specs: Any = None, has_aux: bool = False, batch_specs: Any = None,
               key: jax.Array | None = None, mutable: str = "per_worker",
               donate: bool = True):
    axes = _validate.trainer_axes(axis_name, mesh)
    _validate.trainer_args(loss_fn, optimizer)
    # Typed, for fold_in; None means the loss takes no key (not a default key).
    self.key = None if key is None else jax.random.wrap_key_data(v.key("key", key))
    self.mutable = v.one_of("mutable", mutable, MUTABLE)
    self._nnx = None  # _nnx.Parts of an NNX model (set by init)
    self.loss_fn, self.optimizer, self.mesh = loss_fn, optimizer, mesh
    self.axes = axes
    self.axis_name = axes[0] if len(axes) == 1 else axes
    self.num_workers = math.prod(mesh.shape[a] for a in axes)
    self.param_specs = param_specs
    self.has_aux = has_aux
    self.batch_specs = batch_specs
    self.donate = v.one_of("donate", donate, (True, False))
    self._layout = None
    self._opt_specs = None
    self._sq_groups = [()]
    self._step_fn = None
    # One compiled program for the per-step measurements instead of a dozen eager ops
    # (each eager op on sharded arrays is a dispatch to every device: ~1 ms a step on CPU).
    self._measure = jax.jit(self.measurements)
    self._sync_each_step = all(d.platform == "cpu" for d in mesh.devices.flat)
    self._init_fn = None

  # ---------------------------------------------------------------- specs and layout
  def _param_spec(self, spec_tree, params):
    if spec_tree is None:
      return jax.tree.map(lambda _: P(), params)
    return spec_tree

  def _lead_axes(self, pw) -> tuple:
    """The mesh axes (mesh order) of a per-worker leaf's leading axis; () if replicated."""
    return tuple(a for a in self.mesh.axis_names if a in pw) if pw else ()

  def _lead_size(self, pw) -> int:
    return math.prod(self.mesh.shape[a] for a in self._lead_axes(pw))

  def _specs(self, per_worker, base_specs):
    """PartitionSpec per leaf: per-worker leaves get their axes as a leading dimension."""
    def one(pw, spec):
      return P(self._lead_axes(pw), *spec) if pw else spec
    return jax.tree.map(one, per_worker, base_specs)

  def _base_opt_specs(self, opt_state):
    """Specs of the optimiser state over non-data axes (derived from the params' in init)."""
    if self._opt_specs is not None:
      return self._opt_specs
    return jax.tree.map(lambda _: P(), opt_state)

  def _unstack(self, tree, per_worker):
    return jax.tree.map(lambda pw, x: x[0] if pw else x, per_worker, tree)

  def _stack(self, tree, per_worker):
    return jax.tree.map(lambda pw, x: x[None] if pw else x, per_worker, tree)

  def _free_axes(self, spec) -> frozenset:
    """Mesh axes over which a leaf with this base spec can differ without being sharded."""
    return frozenset(self.mesh.axis_names) - {a for entry in spec for a in comm.axis_names(entry)}

  def _resize(self, shape, spec, grow: bool) -> tuple:
    """Global shape from a local one (grow) or the reverse, for a leaf with this spec."""
    sizes = [math.prod(self.mesh.shape[a] for a in comm.axis_names(e)) for e in spec]
    sizes += [1] * (len(shape) - len(sizes))
    return tuple(n * k if grow else n // k for n, k in zip(shape, sizes))

  def _opt_specs_from_params(self, opt_local, params_abs, pspecs):
    """Optimiser-state leaves shaped like a parameter (adam's mu, nu, ...) are sharded like it.

    A leaf matches a parameter when the parameter's tree path is a suffix of the leaf's path
    and their local shapes agree; every other leaf is replicated over non-data axes.
    """
    if self.param_specs is None:
      return jax.tree.map(lambda _: P(), opt_local)
    flat, _ = jax.tree_util.tree_flatten_with_path(params_abs)
    entries = [(tuple(path), self._resize(x.shape, spec, grow=False), spec)
               for (path, x), spec in zip(flat, jax.tree.leaves(
                   pspecs, is_leaf=lambda s: isinstance(s, P)))]

    def spec_for(path, x):
      path = tuple(path)
      for ppath, shape, spec in entries:
        if len(ppath) <= len(path) and path[len(path) - len(ppath):] == ppath and \
           tuple(x.shape) == shape:
          return spec
      return P()

    return jax.tree_util.tree_map_with_path(spec_for, opt_local)

  def _derive_layout(self, params) -> StateLayout:
    """Fixed point of 'over which axes does each leaf vary' under init and update.

    `init` is traced under shard_map, so an optimiser state whose shapes depend on the axis
    sizes (a 1/W shard, ZeRO) works; probes stack every leaf over all mesh axes so that any
    leaf passes shard_map's check. A leaf is per-worker over the mesh axes it varies over
    that its spec does not shard it over.
    """
    params_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                              params)
    pspecs = self._param_spec(self.param_specs, params_abs)
    found = {}
    every = P(tuple(self.mesh.axis_names))

    def record(key, tree, specs):
      found[key] = jax.tree.map(
          lambda x, spec: self._free_axes(spec) & comm.varying_axes(x), tree, specs)

    def probe_init(p):
      opt = self.optimizer.init(p)
      found["opt_local"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), opt)
      found["opt_vary"] = jax.tree.map(comm.varying_axes, opt)
      return jax.tree.map(lambda x: x[None], opt)

    jax.eval_shape(jax.shard_map(probe_init, mesh=self.mesh, in_specs=(pspecs,),
                                 out_specs=every), params_abs)
    opt_specs = self._opt_specs_from_params(found["opt_local"], params_abs, pspecs)
    opt_abs = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(self._resize(x.shape, spec, grow=True), x.dtype),
        found["opt_local"], opt_specs)
    found["opt"] = jax.tree.map(
        lambda vary, spec: self._free_axes(spec) & vary, found.pop("opt_vary"), opt_specs)
    layout = StateLayout(params=jax.tree.map(lambda _: frozenset(), params_abs),
                         opt_state=found["opt"])
    for _ in range(8):
      def probe_update(p, o, layout=layout):
        p, o = self._unstack(p, layout.params), self._unstack(o, layout.opt_state)
        grads = comm.varying(jax.tree.map(jnp.zeros_like, p), self.axes)
        updates, o = self.optimizer.update(grads, o, p)
        p = optax.apply_updates(p, updates)
        record("params", p, pspecs)
        record("opt", o, opt_specs)
        return jax.tree.map(lambda x: x[None], (p, o))

      stacked = lambda abs_tree, pw: jax.tree.map(
          lambda w, x: jax.ShapeDtypeStruct((self._lead_size(w), *x.shape), x.dtype) if w else x,
          pw, abs_tree)
      in_specs = (self._specs(layout.params, pspecs), self._specs(layout.opt_state, opt_specs))
      jax.eval_shape(jax.shard_map(probe_update, mesh=self.mesh, in_specs=in_specs,
                                   out_specs=every),
                     stacked(params_abs, layout.params), stacked(opt_abs, layout.opt_state))
      new = StateLayout(
          params=jax.tree.map(lambda a, b: a | b, layout.params, found["params"]),
          opt_state=jax.tree.map(lambda a, b: a | b, layout.opt_state, found["opt"]))
      if jax.tree.leaves(new.params) == jax.tree.leaves(layout.params) and \
         jax.tree.leaves(new.opt_state) == jax.tree.leaves(layout.opt_state):
        self._check_params_layout(new.params, pspecs)
        self._opt_specs = opt_specs
        return new
      layout = new
    raise RuntimeError("the per-worker layout of the train state did not settle.")

  def _check_params_layout(self, per_worker, pspecs):
    """A parameter may differ only between workers of the data axes.

    A replicated parameter that the update makes differ over a model axis (`tensor`,
    `pipeline`) would be differentiated as a per-device value there: its gradient would
    lose the sum over that axis. This happens when a transform mixes it with leaves sharded
    over that axis (one flat vector of every gradient leaf).
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(per_worker)
    for (path, axes), spec in zip(flat, jax.tree.leaves(pspecs,
                                                        is_leaf=lambda s: isinstance(s, P))):
      extra = sorted(set(axes) - set(self.axes))
      if extra:
        raise ValueError(
            f"the update makes parameter {jax.tree_util.keystr(path)} (spec {spec}) differ "
            f"over mesh axes {extra}, which are not data axes {self.axes}: the transform "
            f"mixes it with parameters sharded over {extra} (e.g. in one flat vector). Run "
            "the transform on each group of equally sharded leaves "
            "(jaxcomm.parallel.by_sharding, as parallel.Layout.optimizer does).")

  @property
  def layout(self) -> StateLayout:
    if self._layout is None:
      raise ValueError("call init(params) before asking for the layout.")
    return self._layout

  def state_specs(self, state_like) -> TrainState:
    """PartitionSpecs of a train state (leading worker axis on per-worker leaves)."""
    pspecs = self._param_spec(self.param_specs, state_like.params)
    model_specs = None
    if state_like.model_state is not None:  # replicated over the non-data axes
      model_specs = self._specs(self.layout.model_state,
                                jax.tree.map(lambda _: P(), state_like.model_state))
    return TrainState(
        step=P(),
        params=self._specs(self.layout.params, pspecs),
        opt_state=self._specs(self.layout.opt_state, self._base_opt_specs(state_like.opt_state)),
        model_state=model_specs)

  def state_shardings(self, state_like) -> TrainState:
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_specs(state_like),
                        is_leaf=lambda x: isinstance(x, P))

  # ---------------------------------------------------------------- init and step
  def init(self, params) -> TrainState:
    """The initial train state from the (replicated) initial parameters or an NNX model.

    Args:
      params: a parameter tree, or an `nnx.Module` (split into its parameters, which the
        optimiser sees, and its other variables, `TrainState.model_state`).
    """
    model_state = None
    if _nnx.is_module(params):
      self._nnx, params, model_state = _nnx.split(params)
      _validate.mutable_state(self.mutable, model_state, self._nnx.is_variable())
    self._layout = self._derive_layout(params)
    if model_state is not None:  # per worker: the variables the forward pass updates
      per_worker = jax.tree.map(
          lambda var: frozenset(self.axes) if var and self.mutable == "per_worker"
          else frozenset(), self._nnx.is_variable())
      self._layout = dataclasses.replace(self._layout, model_state=per_worker)
    pspecs = self._param_spec(self.param_specs, params)
    opt_out = self._specs(self.layout.opt_state, self._opt_specs)
    param_out = self._specs(self.layout.params, pspecs)
    model_specs = jax.tree.map(lambda _: P(), model_state)
    model_out = self._specs(self.layout.model_state, model_specs)

    def init_local(p, ms):
      opt = self.optimizer.init(p)
      # Per-worker leaves start equal on all workers but are stored once per worker.
      p, opt, ms = (jax.tree.map(lambda pw, x: comm.varying(x, self._lead_axes(pw)),
                                 pw_tree, tree)
                    for pw_tree, tree in ((self.layout.params, p),
                                          (self.layout.opt_state, opt),
                                          (self.layout.model_state, ms)))
      return (self._stack(p, self.layout.params), self._stack(opt, self.layout.opt_state),
              self._stack(ms, self.layout.model_state))

    init_fn = jax.jit(jax.shard_map(init_local, mesh=self.mesh, in_specs=(pspecs, model_specs),
                                    out_specs=(param_out, opt_out, model_out)))
    p, opt, ms = init_fn(params, model_state)
    # Computed, not device_put: on a mesh over every process, device_put of a host value first
    # checks with an all-gather over all devices that each process passed the same value, a
    # collective that jaxcomm.elastic cannot afford once a process has restarted.
    step = jax.jit(lambda: jnp.zeros((), jnp.int32),
                   out_shardings=NamedSharding(self.mesh, P()))()
    return TrainState(step=step, params=p, opt_state=opt, model_state=ms)

  def model(self, state: TrainState, worker: int = 0) -> Any:
    """The trained NNX model: worker `worker`'s parameters and variables merged again.

    Call `.eval()` on it before evaluating (BatchNorm's running averages, no dropout).
    """
    if self._nnx is None:
      raise ValueError("model() needs a Trainer initialised with an NNX model "
                       "(init(model)); with a parameter tree use worker_view(state.params, "
                       "trainer.layout.params).")
    params = self.worker_view(state.params, self.layout.params, worker)
    model_state = self.worker_view(state.model_state, self.layout.model_state, worker)
    return _nnx.merge(self._nnx, params, model_state)

  def batch_spec(self, batch) -> Any:
    if isinstance(self.batch_specs, P):
      return jax.tree.map(lambda _: self.batch_specs, batch)
    if self.batch_specs is not None:
      return self.batch_specs
    return jax.tree.map(lambda _: P(self.axes), batch)

  def _check_batch(self, batch):
    if self.batch_specs is None:
      _validate.batch(batch, self.num_workers, self.axis_name)
      return
    specs = jax.tree.leaves(self.batch_spec(batch), is_leaf=lambda x: isinstance(x, P))
    for x, spec in zip(jax.tree.leaves(batch), specs):
      for dim, axes in enumerate(spec):
        size = math.prod(self.mesh.shape[a] for a in comm.axis_names(axes))
        n = jnp.shape(x)[dim] if jnp.ndim(x) > dim else None
        if n is None or n % size:
          kind = "data" if set(comm.axis_names(axes)) <= set(self.axes) else "mesh"
          raise ValueError(f"the global batch dimension {dim} ({n}) must be divisible by the "
                           f"{kind} axis size {size} (axes {axes!r}).")

  def _extra_axes(self) -> tuple:
    return tuple(a for a in self.mesh.axis_names if a not in self.axes)

  def _build_step(self, state, batch):
    specs = self.state_specs(state)
    layout = self.layout
    loss_fn = self._local_loss()
    # Measurements leave as one value per device, data axes first: nothing is reduced over
    # the non-data axes (tensor, ...) inside the step, so no collective is spent on them.
    out_axes = self.axes + self._extra_axes()

    def step_local(state: TrainState, batch_block):
      params = self._unstack(state.params, layout.params)
      opt_state = self._unstack(state.opt_state, layout.opt_state)
      model_state = self._unstack(state.model_state, layout.model_state)
      # Differentiate w.r.t. a varying copy: each worker gets its own local gradient.
      (loss, (aux, new_model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          comm.varying(params, self.axes), batch_block, model_state, state.step)
      updates, new_opt = self.optimizer.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      sent = comm.counted_bytes(new_opt) - comm.counted_bytes(opt_state)
      new_model_state, model_bytes = self._sync_model_state(new_model_state)
      new_model_state = jax.tree.map(lambda pw, x: comm.varying(x, self.axes) if pw else x,
                                     layout.model_state, new_model_state)
      sent = comm.add_bytes(sent, model_bytes)
      # Squared gradient norms per group of leaves that vary over the same non-data axes
      # (tensor-parallel shards, pipeline stages): `measurements` sums each group over its
      # axes, so no collective is spent on the norm.
      groups = {}
      for g in jax.tree.leaves(grads):
        key = tuple(a for a in self._extra_axes() if a in comm.varying_axes(g))
        groups[key] = groups.get(key, 0.0) + jnp.sum(jnp.square(g.astype(jnp.float32)))
      self._sq_groups = sorted(groups)
      if self._sq_groups in ([()], []):
        measurements = {"loss": loss, "grad_norm": jnp.sqrt(groups.get((), 0.0)), **aux}
      else:
        measurements = {"loss": loss, "grad_sq": [groups[k] for k in self._sq_groups], **aux}
      skipped = sync.skipped_steps(new_opt)
      if skipped is not None:  # steps skipped so far (sync.skip_nonfinite)
        measurements["skipped_steps"] = skipped
      measurements = jax.tree.map(lambda x: comm.varying(x, out_axes)[None], measurements)
      new_state = TrainState(step=state.step + 1,
                             params=self._stack(new_params, layout.params),
                             opt_state=self._stack(new_opt, layout.opt_state),
                             model_state=self._stack(new_model_state, layout.model_state))
      return new_state, measurements, sent

    out_m = jax.eval_shape(
        jax.shard_map(lambda s, b: step_local(s, b)[1], mesh=self.mesh,
                      in_specs=(specs, self.batch_spec(batch)),
                      out_specs=P(out_axes)), state, batch)
    m_specs = jax.tree.map(lambda _: P(out_axes), out_m)
    return jax.jit(jax.shard_map(step_local, mesh=self.mesh,
                                 in_specs=(specs, self.batch_spec(batch)),
                                 out_specs=(specs, m_specs, P())),
                   donate_argnums=(0,) if self.donate else ())

  def _local_loss(self) -> Callable:
    """`(params, batch, model_state, step) -> (loss, (aux, model_state))` on one worker.

    Calls the user's loss in the form it was given: `loss_fn(params, batch)`, an NNX
    model merged from the parameters and variables (`loss_fn(model, batch)`), plus this
    step's and worker's key when the Trainer has one.
    """
    def loss(params, batch, model_state, step):
      worker = lax.axis_index(self.axes)  # the index of this worker's row of the batch
      extra = () if self.key is None else (_nnx.step_key(self.key, step, worker),)
      if self._nnx is None:
        out = self.loss_fn(params, batch, *extra)
      else:
        model = _nnx.merge(self._nnx, params, _nnx.reseed(self._nnx, model_state, step, worker))
        out = self.loss_fn(model, batch, *extra)
        model_state = _nnx.updated(self._nnx, model, model_state)
      value, aux = out if self.has_aux else (out, {})
      return value, (aux, model_state)
    return loss

  def _sync_model_state(self, model_state) -> tuple[Any, float]:
    """With mutable="mean", the updated variables averaged over the data axes (and bytes)."""
    if self.mutable != "mean" or model_state is None:
      return model_state, 0.0
    variables = self._nnx.is_variable()
    leaves = [x for var, x in zip(jax.tree.leaves(variables), jax.tree.leaves(model_state))
              if var]
    means, nbytes = comm.mean(leaves, self.axes)
    means = iter(means)
    return jax.tree.map(lambda var, x: next(means) if var else x, variables,
                        model_state), nbytes

  def step_fn(self, state, batch) -> Callable:
    """The jitted step `(state, batch) -> (state, per-device measurements, bytes sent)`.

    With `donate` (the default) it consumes `state`: lowering and compiling it (e.g.
    `comm.inspect`) leaves the state usable, calling it does not.
    """
    if self._step_fn is None:
      self._step_fn = self._build_step(state, batch)
    return self._step_fn

  def measurements(self, per_device, sent=None) -> dict:
    """`step`'s measurements from the per-device ones that `step_fn` returns.

    Values are per worker (the data axes) under `per_worker`, means over workers at the top
    level. Over non-data axes values are equal and taken once, except the squared gradient
    norms of leaves sharded over such axes (tensor parallelism), which are summed there.
    """
    extra = self._extra_axes()
    shape = (self.num_workers, *(self.mesh.shape[a] for a in extra))

    def reduce(x, sum_axes=()):
      x = x.reshape(shape)
      for i in reversed(range(len(extra))):
        x = x.sum(axis=1 + i) if extra[i] in sum_axes else jnp.take(x, 0, axis=1 + i)
      return x

    per_device = dict(per_device)
    grad_sq = per_device.pop("grad_sq", None)
    per_worker = jax.tree.map(reduce, per_device)
    if grad_sq is not None:
      per_worker["grad_norm"] = jnp.sqrt(sum(reduce(x, key)
                                             for x, key in zip(grad_sq, self._sq_groups)))
    means = jax.tree.map(lambda x: jnp.mean(x, axis=0), per_worker)
    out = {**means, "per_worker": per_worker}
    if sent is not None:
      out["wire_bytes"] = sent
    return out

  def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
    """One training step on a global batch; returns the new state and measurements.

    Measurements: `loss` and `grad_norm` (means over workers; per-worker values under
    `per_worker`), `wire_bytes` sent by each device in this step, and `skipped_steps` (the
    steps skipped so far) when the transform contains `sync.skip_nonfinite`.
    """
    state, per_device, sent = self.dispatch(state, batch)
    return state, self.measure(per_device, sent)

  def dispatch(self, state: TrainState, batch) -> tuple[TrainState, Any, jax.Array]:
    """One step without reading anything back: `(state, per-device measurements, bytes)`.

    Everything stays on the devices (`fit` reads the values only at log steps, so the host
    never waits for a step it does not log); `measure` turns them into `step`'s dict.
    """
    self._check_batch(batch)
    state, per_device, sent = self.step_fn(state, batch)(state, batch)
    if self._sync_each_step:
      # XLA:CPU can deadlock in an all-reduce rendezvous when executions of a collective
      # program overlap across emulated devices: a device runs step t + 1 into a collective
      # while others still wait for a thread for step t (seen with jaxlib 0.10.2 whenever
      # the collective comes first in the program, e.g. `local.delayed`). One step at a time.
      jax.block_until_ready(state)
    return state, per_device, sent

  def measure(self, per_device, sent) -> dict:
    """`step`'s measurements from `dispatch`'s outputs (one compiled program, on device)."""
    return self._measure(per_device, sent)

  def shard_batch(self, local_batch) -> Any:
    """Turns this process's share of the global batch (numpy) into sharded global arrays."""
    sharding = jax.tree.map(lambda s: NamedSharding(self.mesh, s),
                            self.batch_spec(local_batch), is_leaf=lambda x: isinstance(x, P))
    return jax.tree.map(jax.make_array_from_process_local_data, sharding, local_batch)

  def worker_view(self, tree_stacked, per_worker_tree, worker: int = 0):
    """One worker's view of a state tree: per-worker leaves indexed, replicated ones as is.

    `worker` counts the workers of the data axes (`num_workers`); a leaf stored once per
    replica gives that worker's replica's copy. Leading axes over non-data axes stay.
    """
    sizes = [self.mesh.shape[a] for a in self.axes]
    coords = dict(zip(self.axes, jnp.unravel_index(worker, sizes))) if sizes else {}

    def one(pw, x):
      lead = self._lead_axes(pw)
      if not lead:
        return x
      x = x.reshape(*(self.mesh.shape[a] for a in lead), *x.shape[1:])
      keep = [a for a in lead if a not in coords]
      x = x[tuple(int(coords[a]) if a in coords else slice(None) for a in lead)]
      return x.reshape(-1, *x.shape[len(keep):]) if keep else x

    return jax.tree.map(one, per_worker_tree, tree_stacked)
