"""The settings toolkit: what a plug-in (a method or model module) and a program use to declare
and check their settings. It imports nothing of experiments/, so plug-ins import it (and
jaxcomm) and nothing above them.

* `from_factory`: a method's settings read from its library factory's signature, so a default
  lives in one place, the factory; `call`: the factory called with every setting it takes.
* Range checks on a settings tree (`int_at_least`, `number_in`, `one_of`, `names_in`,
  `values_at_least`), each a ValueError naming `config.<path>` in the library's vocabulary
  (`jaxcomm._validate`: "must be ...; got ...").
* `Task` (what a model module's `build` returns) and `ModelContext` (what it receives);
  `nesterov`, the outer optimiser of DiLoCo-style methods (settings `outer_lr`,
  `outer_momentum`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from typing import Any, Callable

import jax
import ml_collections
import optax
from ml_collections import config_dict

from jaxcomm import _validate
from jaxcomm import sim

_SIMPLE_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


# ---------------------------------------------------------------- settings from signatures
def _type_of(annotation: Any, name: str, factory: Callable) -> type:
  """The field type of a parameter whose default is None, from its annotation."""
  text = annotation if isinstance(annotation, str) else str(annotation)
  for token in (t.strip() for t in text.split("|")):
    if token in _SIMPLE_TYPES:
      return _SIMPLE_TYPES[token]
  raise ValueError(f"{factory.__name__}({name}=None): give the setting's type in `types`.")


def from_factory(factory: Callable, *, skip: tuple = (), types: dict | None = None,
                 **own: Any) -> ml_collections.ConfigDict:
  """A method's settings: every keyword default of `factory` (minus `skip`), plus `own`.

  The factory's defaults are read, never restated, so they have one home. A default of None
  becomes a typed placeholder (from `types` or the annotation) that the command line can set.
  `own` holds settings the factory does not take as such (e.g. `outer_lr` for the outer
  optimiser a method module builds) and may override a default only by naming a setting the
  factory lacks: a clash is an error.

  >>> from jaxcomm import local
  >>> s = from_factory(local.stale, skip=("inner", "axis_name"), delay=1)
  >>> s.delay, s.dc_lambda, s.compensation
  (1, 0.04, None)
  """
  types = dict(types or {})
  params = inspect.signature(factory).parameters
  fields = {}
  hints = {}
  for name, p in params.items():
    if name in skip or p.default is inspect.Parameter.empty:
      continue
    if name in own:
      raise ValueError(f"{factory.__name__} defaults {name}={p.default!r}: a method's "
                       f"settings read it from the factory instead of setting it.")
    hints[name] = p.annotation
    fields[name] = p.default
  cfg = ml_collections.ConfigDict()
  for name, value in {**fields, **own}.items():
    if value is None:
      kind = types.get(name) or _type_of(hints.get(name, ""), name, factory)
      setattr(cfg, name, config_dict.placeholder(kind))
    elif isinstance(value, (bool, int, float, str, tuple)):
      setattr(cfg, name, value)
    elif name in types:  # an object default (a codec, ...) shown as its spec string
      setattr(cfg, name, config_dict.placeholder(types[name]))
    else:
      raise ValueError(f"{factory.__name__}({name}={value!r}): a default that is not a "
                       f"number, string or None needs a spec type in `types`.")
  return cfg


def call(factory: Callable, settings: ml_collections.ConfigDict, **given: Any) -> Any:
  """`factory(**kwargs)` with every setting that names one of its parameters, then `given`
  (what the method module computes: the inner optimiser, axes, codecs from specs, ...).

  Passing settings by name, all of them, means a setting cannot be silently forgotten.

  >>> import optax
  >>> s = ml_collections.ConfigDict(dict(learning_rate=0.1, eps=1e-8, name="adam"))
  >>> call(optax.adam, s).init({"w": 0.0})[0].count
  Array(0, dtype=int32)
  """
  params = inspect.signature(factory).parameters
  kwargs = {k: settings[k] for k in settings.keys() if k in params and k not in given}
  return factory(**kwargs, **given)


# ---------------------------------------------------------------- range checks
def get(c, path: str) -> Any:
  """config.<path> (`path` dotted, e.g. "method.sync_every").

  >>> get({"method": {"sync_every": 5}}, "method.sync_every")
  5
  """
  for part in path.split("."):
    c = c[part]
  return c


def int_at_least(c, path: str, low: int) -> int:
  """config.<path> is an integer >= low, else a ValueError naming it; returns it.

  >>> int_at_least({"steps": 0}, "steps", 1)
  Traceback (most recent call last):
  ValueError: config.steps must be an integer >= 1, got 0.
  """
  return _validate.integer(f"config.{path}", get(c, path), low=low)


def number_in(c, path: str, low: float | None = None, high: float | None = None, *,
              low_open: bool = False, high_open: bool = False) -> float:
  """config.<path> is a finite number in the interval (either bound optional, open or
  closed), else a ValueError naming it; returns it.

  >>> number_in({"optimizer": {"lr": 0}}, "optimizer.lr", 0, low_open=True)
  Traceback (most recent call last):
  ValueError: config.optimizer.lr must be a finite number in (0, inf), got 0.0.
  """
  return _validate.number(f"config.{path}", get(c, path), low=low, high=high,
                          low_open=low_open, high_open=high_open)


def one_of(c, path: str, allowed) -> Any:
  """config.<path> is one of `allowed`, else a ValueError naming it; returns it.

  >>> one_of({"data": {"split": "dev"}}, "data.split", ("all", "train", "test"))
  Traceback (most recent call last):
  ValueError: config.data.split must be one of 'all', 'train', 'test'; got 'dev'.
  """
  return _validate.one_of(f"config.{path}", get(c, path), tuple(allowed))


def names_in(c, path: str, allowed) -> list:
  """config.<path>: comma-separated names out of `allowed` ("": all of them, in order), else
  a ValueError naming the first unknown one and the allowed names.

  >>> names_in({"only": "b"}, "only", ["a", "b"]), names_in({"only": ""}, "only", ["a", "b"])
  (['b'], ['a', 'b'])
  """
  names = [n for n in (get(c, path) or "").split(",") if n] or list(allowed)
  for name in names:
    _validate.one_of(f"config.{path}", name, tuple(allowed))
  return names


def values_at_least(c, path: str, low: float, kind: type = numbers.Integral) -> tuple:
  """config.<path> is a non-empty tuple of `kind` (integers by default) >= low, else a
  ValueError naming it; returns the tuple (a sweep's values).

  >>> values_at_least({"hs": (1, 10)}, "hs", 1)
  (1, 10)
  """
  values = get(c, path)
  if not isinstance(values, tuple) or not values or not all(
      isinstance(v, kind) and not isinstance(v, bool) and v >= low for v in values):
    what = "integers" if kind is numbers.Integral else "numbers"
    raise ValueError(f"config.{path} must be a non-empty tuple of {what} >= {low} (written "
                     f"--config.{path}=1,2); got {values!r}.")
  return values


# ---------------------------------------------------------------- what a model returns
# Mesh axes that split the model, not the batch; every other axis splits the batch.
MODEL_AXES = ("tensor", "sequence", "pipeline")


@dataclasses.dataclass(frozen=True)
class Task:
  """What a model module's `build` returns: the model, its loss and its data.

  Attributes:
    model: the model (Flax linen or NNX).
    loss_fn: `(params, batch) -> loss`, or `(loss, aux)` when `has_aux`.
    has_aux: whether `loss_fn` returns `(loss, aux)`.
    params: the initial parameters (an NNX module: the Trainer splits it), or their
      `jax.ShapeDtypeStruct`s when built abstract.
    batches: `step -> this process's share of global batch number step`.
    specs: PartitionSpecs of the parameters (None: replicated).
    batch_specs: PartitionSpecs of the batch (None: leading dimension over the batch axes).
    mutable: how an NNX model's mutable variables are kept: "per_worker" or "mean".
  """
  model: Any
  loss_fn: Callable
  has_aux: bool
  params: Any
  batches: Callable[[int], dict]
  specs: Any = None
  batch_specs: Any = None
  mutable: str = "per_worker"


@dataclasses.dataclass(frozen=True)
class ModelContext:
  """What a model module's `build` receives besides its own settings.

  Attributes:
    config: the whole run's settings (read-only; config.data, config.seed, config.mesh).
    mesh_shape: {axis: size} of the run's mesh.
    layout: the `parallel.Layout` the model's `layout()` returned, or None.
    key: the run's PRNG key, `jax.random.key(config.seed)`.
    abstract: build `jax.ShapeDtypeStruct`s instead of initialising (see `init`).
    batches: `step -> batch` of config.data (the run's batches).
    dataset: `() -> the loaded dataset` of config.data.name (None for a folder of files).
  """
  config: ml_collections.ConfigDict
  mesh_shape: dict
  layout: Any
  key: jax.Array
  abstract: bool
  batches: Callable[[int], dict]
  dataset: Callable[[], Any]

  def init(self, fn: Callable) -> Callable:
    """`fn` (a model's init) jitted, or its shapes only when the run is built abstract."""
    return functools.partial(jax.eval_shape, fn) if self.abstract else jax.jit(fn)

  @property
  def workers(self) -> int:
    """The data-parallel workers: the product of every axis that splits the batch."""
    return math.prod(n for a, n in self.mesh_shape.items() if a not in MODEL_AXES)

  def data_parallel_only(self, also: tuple = ()) -> None:
    """Refuses a mesh with model axes (or `also`): a model without layouts of its own."""
    if set(self.mesh_shape) & {*MODEL_AXES, *also}:
      raise ValueError(f"config.mesh {self.config.mesh!r} lays out the linen LM only; use "
                       f"config.model.name 'lm' or a mesh of data axes.")


# ---------------------------------------------------------------- shared by methods
def nesterov(lr: float, momentum: float) -> optax.GradientTransformation:
  """The outer optimiser of DiLoCo-style methods (settings `outer_lr`, `outer_momentum`):
  SGD with Nesterov momentum, plain SGD at momentum 0.

  >>> import jax.numpy as jnp
  >>> tx, grads = nesterov(0.5, 0.9), {"w": jnp.ones(())}
  >>> updates, _ = tx.update(grads, tx.init(grads))
  >>> round(float(updates["w"]), 4)  # -lr * (g + momentum * g) on the first step
  -0.95
  """
  lr = _validate.number("outer_lr", lr, low=0, low_open=True)
  momentum = _validate.number("outer_momentum", momentum, low=0, high=1, high_open=True)
  if not momentum:
    return optax.sgd(lr)
  return optax.sgd(lr, momentum=momentum, nesterov=True)


GOSSIP_SKIP = ("inner", "outer", "graph", "num_workers", "axis_name")  # what build supplies


def gossip_schedule(factory: Callable, settings: ml_collections.ConfigDict, ctx: Any) -> Any:
  """A gossip DiLoCo schedule (`local.factored_gossip_diloco`, `local.gasloc`) from a
  method's settings: the graph `graph` named on the run's workers, DiLoCo's outer Nesterov
  SGD (`outer_lr`, `outer_momentum`), the inner optimiser and axis of the run."""
  from jaxcomm import sync  # noqa: PLC0415 (only the gossip methods need it)
  graph = sync.gossip_graph(one_of(ctx.config, "method.graph", sync.GRAPHS), ctx.num_workers)
  return call(factory, settings, inner=ctx.inner, graph=graph, axis_name=ctx.axis_name,
              outer=nesterov(settings.outer_lr, settings.outer_momentum))


def sync_period(settings: ml_collections.ConfigDict) -> int:
  """The `period` hook of a method that syncs once every `sync_every` inner steps."""
  return settings.sync_every


def elastic_rounds(settings: ml_collections.ConfigDict) -> sim.Semantics:
  """The `failure_semantics` hook of a method that `jaxcomm.elastic` runs in rounds of
  `sync_every` inner steps: a failed replica leaves the quorum until it is healed, and a
  failure costs every survivor the round in flight."""
  return sim.Semantics("elastic", round_steps=settings.sync_every)


def inner_step(settings: ml_collections.ConfigDict) -> str:
  """The `local_step` hook of a method whose worker step is the gradient and the inner
  optimiser (its outer step runs once a period)."""
  del settings
  return "inner"
