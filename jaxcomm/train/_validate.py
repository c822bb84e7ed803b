"""The checks behind `jaxcomm.train`'s public API (built on `jaxcomm._validate`)."""

from __future__ import annotations

from typing import Any

import jax
from jax.extend import core as jex_core
import numpy as np

from jaxcomm import _validate as v
from jaxcomm import comm


def batch_axes(value: Any, mesh: Any) -> tuple:
  """The batch axes of a step as a tuple: at least one, all in the mesh."""
  v.mesh("mesh", mesh)
  if value is None or value == ():
    raise ValueError("batch_axes must name at least one mesh axis; for one device use a "
                     "mesh of size 1 or call the transform directly.")
  value = v.axis_name("batch_axes", value, allow_none=False)
  axes = comm.axis_names(value)
  if any(a not in mesh.axis_names for a in axes):
    raise ValueError(f"batch_axes {value!r} is not in the mesh; allowed axis names: "
                     f"{tuple(mesh.axis_names)}.")
  return axes


def mutable_state(mutable: str, model_state: Any, is_variable: Any) -> None:
  """With mutable="mean", every variable the forward pass updates is a float (averaged)."""
  if mutable != "mean":
    return
  for (path, x), var in zip(jax.tree_util.tree_leaves_with_path(model_state),
                            jax.tree.leaves(is_variable)):
    if var and not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
      raise ValueError(f"mutable='mean' averages the model's variables over the data axes, "
                       f"but {jax.tree_util.keystr(path)} is {x.dtype}; use "
                       f"mutable='per_worker'.")


def batch(tree: Any, num_workers: int, axes: Any) -> None:
  """Every leaf of a global batch has a leading dimension divisible by the workers."""
  for x in jax.tree.leaves(tree):
    n = np.shape(x)[0] if np.ndim(x) else None
    if n is None or n % num_workers:
      raise ValueError(f"the global batch size ({n}) must be divisible by the data axis "
                       f"size {num_workers} (batch_axes={axes!r}).")


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


def checkpoint_processes(processes: Any) -> frozenset | None:
  """None (every process) or a set of one process index."""
  if processes is None:
    return None
  try:
    out = frozenset(v.integer("processes", p, low=0) for p in processes)
  except TypeError as e:
    raise ValueError(f"processes must be None or a set of process indices, got "
                     f"{processes!r}.") from e
  if len(out) != 1:
    raise ValueError(f"processes must be None (all processes) or a set of one process index, "
                     f"got {sorted(out)}.")
  return out


# Primitives that carry axis names but move nothing between devices.
_NOT_COLLECTIVES = ("pvary", "axis_index", "axis_size")


def _collective_axes(jaxpr: Any, found: set) -> set:
  """Mesh axis names of every collective in a jaxpr, nested jaxprs (cond branches, scans,
  custom derivatives, inner jits) included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    if eqn.primitive.name not in _NOT_COLLECTIVES:
      for key in ("axes", "axis_name"):
        if key in eqn.params:
          found.update(a for a in comm.axis_names(eqn.params[key]) if isinstance(a, str))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
          _collective_axes(sub, found)
  return found


def batch_axes_reduced(step_jaxpr: Any, config: Any) -> None:
  """Every mesh axis the batch is split over is reduced by someone in the step.

  A batch axis that no collective of the step crosses trains copies that are never averaged: each
  worker along it sees only its share of the data and nothing ever combines them (a mesh axis
  misspelt `fdsp` for `fsdp` does this silently). The check reads the traced step (the jaxpr of
  `make_step`'s one trace of the shard_map'ed step: the loss, its gradient and the transform's
  update) and collects the axis names of its collectives, every branch of a `lax.cond` included,
  so a method that syncs every H steps counts. Reading the program rather than the transform's
  arguments makes it hold for any transform, a user's own included, and for reductions inside the
  layout (ZeRO-3's reduce-scatter, the gradient of an FSDP all-gather). Any collective counts
  (psum, reduce-scatter, all-gather, all-to-all, ppermute: gossip mixes by ppermute); a collective
  of a scalar flag alone, such as `sync.skip_nonfinite`'s, also counts, so the check can miss a
  transform that reduces nothing but such a flag. Axes of size 1 split nothing and are not
  checked.

  Args:
    step_jaxpr: the step's jaxpr for a state and a batch (`jax.jit(...).trace(...).jaxpr`).
    config: the step's `StepConfig` (its batch axes and mesh).

  Raises:
    ValueError: naming the first batch axis no collective crosses.
  """
  axes, mesh = config.batch_axes, config.mesh
  reduced = _collective_axes(step_jaxpr, set())
  for a in axes:
    if mesh.shape[a] > 1 and a not in reduced:
      raise ValueError(
          f"the batch is split over mesh axis {a!r} (size {mesh.shape[a]}), but no "
          f"collective of the step crosses it: the workers along {a!r} would train copies "
          f"that are never averaged. Synchronise over {a!r} in the transform (e.g. "
          f"axis_name={tuple(axes)!r}), reduce it in the layout, or leave it out of "
          f"batch_axes; reduced axes: {sorted(reduced)}.")


def trials(value: Any) -> int | None:
  """None (no population) or the number of trials, an integer >= 1."""
  return None if value is None else v.integer("trials", value, low=1)


def trial_keys(key: Any, num_trials: int) -> jax.Array:
  """One typed PRNG key per trial (shape (trials,)), from typed keys or raw key data."""
  default = jax.random.key(0)
  if isinstance(key, (jax.Array, np.ndarray)):
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
      if key.shape == (num_trials,) and jax.random.key_impl(key) == \
         jax.random.key_impl(default):
        return key
    elif key.dtype == np.uint32 and key.shape == (num_trials,
                                                   *jax.random.key_data(default).shape):
      return jax.random.wrap_key_data(key)
  raise ValueError(f"key must be one PRNG key per trial (shape ({num_trials},), e.g. "
                   f"jax.random.split(jax.random.key(0), {num_trials})) with trials="
                   f"{num_trials}, got {key!r}.")


def trial_axis(name: str, tree: Any, num_trials: int | None) -> None:
  """With trials, every leaf carries a leading trial axis of that size."""
  if num_trials is None:
    return
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if np.ndim(x) < 1 or np.shape(x)[0] != num_trials:
      raise ValueError(f"with trials={num_trials} every leaf of {name} carries a leading "
                       f"trial axis of size {num_trials} (e.g. jax.vmap(model.init)(keys)), "
                       f"but {name}{jax.tree_util.keystr(path)} has shape {np.shape(x)}.")


def params_layout(per_worker: Any, param_specs: Any, axes: tuple) -> None:
  """A parameter may differ only between workers of the data axes.

  A replicated parameter that the update makes differ over a model axis (`tensor`,
  `pipeline`) would be differentiated as a per-device value there: its gradient would lose
  the sum over that axis. This happens when a transform mixes it with leaves sharded over
  that axis (one flat vector of every gradient leaf).
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(per_worker)
  specs = jax.tree.leaves(param_specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
  for (path, pw), spec in zip(flat, specs):
    extra = sorted(set(pw) - set(axes))
    if extra:
      raise ValueError(
          f"the update makes parameter {jax.tree_util.keystr(path)} (spec {spec}) differ "
          f"over mesh axes {extra}, which are not data axes {axes}: the transform "
          f"mixes it with parameters sharded over {extra} (e.g. in one flat vector). Run "
          "the transform on each group of equally sharded leaves "
          "(jaxcomm.parallel.by_sharding, as parallel.Layout.optimizer does).")


def step_batch(config: Any, tree: Any) -> None:
  """A global batch fits the step: its dimensions divide over the axes that split them."""
  trial_axis("batch", tree, config.trials)
  tree = config.one_trial(tree)  # the per-trial batch, against the per-trial specs
  if config.batch_specs is None:
    axes = config.batch_axes
    batch(tree, config.num_workers, axes[0] if len(axes) == 1 else axes)
    return
  specs = jax.tree.leaves(config.batch_specs_for(tree),
                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  cut = 0 if config.trials is None else 1
  for x, spec in zip(jax.tree.leaves(tree), specs):
    for dim, axes in enumerate(spec[cut:]):
      size = int(np.prod([config.mesh.shape[a] for a in comm.axis_names(axes)]))
      n = np.shape(x)[dim] if np.ndim(x) > dim else None
      if n is None or n % size:
        kind = "data" if set(comm.axis_names(axes)) <= set(config.batch_axes) else "mesh"
        raise ValueError(f"the global batch dimension {dim} ({n}) must be divisible by the "
                         f"{kind} axis size {size} (axes {axes!r}).")
