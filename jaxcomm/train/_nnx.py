"""Flax NNX models in the Trainer: split into a graph, parameters and the other variables.

`Trainer.init(model)` splits an `nnx.Module` with `nnx.split(model, nnx.Param, ...)`:

* the **parameters** become a plain nested dict of arrays (`nnx.to_pure_dict`), laid out
  exactly like a linen model's `params["params"]`: this is what the optimiser, the
  collectives and the per-worker layout see, so every transform and `param_specs` work on
  NNX models as they do on linen ones;
* the **other variables** (BatchNorm statistics, RNG stream keys and counts, any
  `nnx.Variable` of the user's) become the train state's `model_state`, also a pure dict.

Inside the step the model is merged again (`nnx.merge`) from the traced values, so nothing
of the Python object is mutated across trace levels (the `TraceContextError` of a model
captured by a closure). RNG streams are *reseeded every step*: each stream's key becomes
`step_key(base, step, worker)` of the key it was created with and its count restarts at 0,
so dropout masks differ between workers and steps, are a pure function of (seed, step,
worker), and a resumed run draws exactly what the uninterrupted one drew. The streams' base
keys stay in `model_state` unchanged; the other variables come back from the forward pass
updated (per worker, or averaged over the data axes: `Trainer(mutable=...)`).

flax.nnx is imported only once a model is an NNX module (0.4 s of every process's start-up,
paid by every run of a linen model otherwise): whoever built that module imported it already.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any

import jax
from flax import traverse_util

if TYPE_CHECKING:
  from flax import nnx

RNG_KEY, RNG_COUNT, VARIABLE = "rng_key", "rng_count", "variable"


def is_module(x: Any) -> bool:
  """Whether `x` is an NNX graph node (an `nnx.Module` or other `nnx.Pytree`)."""
  nnx = sys.modules.get("flax.nnx")  # not imported: `x` cannot be one of its modules
  return nnx is not None and isinstance(x, nnx.Pytree)


def step_key(key: jax.Array, step: Any, worker: Any) -> jax.Array:
  """The key worker `worker` uses at step `step`: `fold_in(fold_in(key, step), worker)`.

  A pure function of (key, step, worker): a resumed run reproduces it from the saved step.
  `key` may be an array of keys (an NNX stream split for a vmapped layer): each is folded.

  Example:
    >>> import jax
    >>> k = step_key(jax.random.key(0), 3, 1)
    >>> bool((jax.random.key_data(k) == jax.random.key_data(
    ...     jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 3), 1))).all())
    True
  """
  fold = lambda k: jax.random.fold_in(jax.random.fold_in(k, step), worker)
  if key.shape == ():
    return fold(key)
  return jax.vmap(fold)(key.reshape(-1)).reshape(key.shape)


def _abstract(state: nnx.State) -> nnx.State:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def _kind(variable: Any) -> str:
  from flax import nnx  # lazy: only for NNX models (see the module docstring)
  if isinstance(variable, nnx.RngKey):
    return RNG_KEY
  if isinstance(variable, nnx.RngCount):
    return RNG_COUNT
  return VARIABLE


@dataclasses.dataclass(frozen=True)
class Parts:
  """What the Trainer keeps of an NNX model besides the arrays: its graph and the types."""
  graphdef: Any
  params: nnx.State  # abstract: every nnx.Param (types and paths)
  rest: nnx.State    # abstract: every other variable
  kinds: dict        # pure dict like `rest`: RNG_KEY, RNG_COUNT or VARIABLE per leaf

  def is_variable(self) -> dict:
    """Pure dict like `rest`: True for the variables the forward pass updates."""
    return jax.tree.map(lambda k: k == VARIABLE, self.kinds)


def split(model: Any) -> tuple[Parts, dict, dict]:
  """(parts, params, model_state): the model's parameters and other variables as pure dicts."""
  from flax import nnx  # lazy: only for NNX models (see the module docstring)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  kinds = nnx.to_pure_dict(rest, extract_fn=_kind)
  parts = Parts(graphdef, _abstract(params), _abstract(rest), kinds)
  return parts, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def _state(template: nnx.State, pure: dict) -> nnx.State:
  from flax import nnx  # lazy: only for NNX models (see the module docstring)
  state = jax.tree.map(lambda x: x, template)  # a fresh copy: replace_by_pure_dict mutates
  nnx.replace_by_pure_dict(state, pure)
  return state


def merge(parts: Parts, params: dict, model_state: dict) -> Any:
  """The NNX model with these parameters and other variables."""
  from flax import nnx  # lazy: only for NNX models (see the module docstring)
  return nnx.merge(parts.graphdef, _state(parts.params, params),
                   _state(parts.rest, model_state))


def reseed(parts: Parts, model_state: dict, step: Any, worker: Any) -> dict:
  """`model_state` with every RNG stream at `step_key(its key, step, worker)`, count 0."""
  def one(kind, x):
    if kind == RNG_KEY:
      return step_key(x, step, worker)
    if kind == RNG_COUNT:
      return jax.numpy.zeros_like(x)
    return x
  return jax.tree.map(one, parts.kinds, model_state)


def updated(parts: Parts, model: Any, model_state: dict) -> dict:
  """The variables after the forward pass; RNG streams keep their base keys (`model_state`).

  Variables the model created during the call (`sow`n intermediates) are not kept.
  """
  from flax import nnx  # lazy: only for NNX models (see the module docstring)
  after = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))))
  before = traverse_util.flatten_dict(model_state)
  kinds = traverse_util.flatten_dict(parts.kinds)
  return traverse_util.unflatten_dict(
      {path: after[path] if kind == VARIABLE else before[path] for path, kind in kinds.items()})
