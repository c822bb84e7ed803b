"""The hooks of a method module, in one record with their defaults (`Hooks`, `hooks`).

Every program reads a method module through `hooks(module)`, never with getattr: a hook has
one name and one default, listed here. Adding a hook is one line in `Hooks` (its name, its
signature, its default) and one entry in its docstring.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from types import ModuleType
from typing import Callable

from jaxcomm import sim


@dataclasses.dataclass(frozen=True)
class Hooks:
  """A method module's functions: `defaults` and `build`, and every optional hook with its
  default (what a module that does not define the hook gets).

  A public function of a method module must be one of these: a misspelt hook
  (`overlap_step`) is an error naming it, not ignored; a helper's name starts with `_`.
  `settings` below is the method's settings (config.method: its `defaults()`, with what the
  config file and the command line set, and `name`).

  Attributes:
    defaults: `() -> ml_collections.ConfigDict`, required: the method's settings and their
      defaults (`experiments.toolkit.from_factory` reads them from the library factory).
    build: `(settings, ctx) -> optax.GradientTransformation`, required: the method's
      transform around `ctx.inner`, the inner optimiser (`ctx`: `experiments.build.Context`,
      the mesh axes, workers, key, codec and participation parsers).
    wrap_loss: `(settings, loss_fn, ctx) -> loss_fn`: the loss each worker differentiates
      (ACCO: its mean over the micro-batches a worker reaches). Default: `loss_fn` itself.
    period: `(settings) -> int`: the steps of one sync period: the method syncs at the end
      of each (an elastic run's round ends there, so a process that joins takes part from the
      next sync and one that dies costs the period in flight). Default 1: a sync every step.
    overlap_steps: `(settings) -> int`: how many later steps a sync overlaps on the simulated
      clock (`jaxcomm.sim`; the comparison and the planner). Default 0.
    overlap_backward: `(settings) -> bool`: the all-reduce overlaps the backward pass bucket
      by bucket (`sim.backward_overlap`). Default False.
    local_step: `(settings) -> str | None`: the name of the computation a worker runs each
      step, for the comparison's compute figure; "inner" (the gradient and the inner
      optimiser, as data parallelism and DiLoCo) shares one measured figure with every
      method that names it. Default None: the method's own one-device step is measured (its
      codec and transform included).
    tuning: `() -> list[dict]`: the settings of the comparison's tuned ruleset, 1 to 5
      items, each setting method settings by name and the optimiser's as
      "optimizer.<name>". Default `[{}]`: the method's own settings only.
    failure_semantics: `(settings) -> jaxcomm.sim.Semantics`: what a run of the method does
      when a device fails, on the simulated clock (`sim.simulate_failures`; the comparison's
      `--failures`): "elastic" (rounds of its period under `jaxcomm.elastic`'s quorum rules)
      or "decoupled" (learners that never wait); the caller sets the replicas. Default
      `sim.Semantics()`: synchronous, the job restarts from its last checkpoint.
  """
  defaults: Callable
  build: Callable
  wrap_loss: Callable = lambda settings, loss_fn, ctx: loss_fn
  period: Callable = lambda settings: 1
  overlap_steps: Callable = lambda settings: 0
  overlap_backward: Callable = lambda settings: False
  local_step: Callable = lambda settings: None
  tuning: Callable = lambda: [{}]
  failure_semantics: Callable = lambda settings: sim.Semantics()


NAMES = tuple(f.name for f in dataclasses.fields(Hooks))
REQUIRED = tuple(f.name for f in dataclasses.fields(Hooks)
                 if f.default is dataclasses.MISSING)


@functools.lru_cache(maxsize=None)
def hooks(module: ModuleType) -> Hooks:
  """The `Hooks` of a method module (read once per module).

  Raises:
    ValueError: naming the module and the function, for a required function it lacks, a
      hook that is not callable, or a public function that is no hook (with the hook it
      probably meant).

  >>> from experiments import methods
  >>> h = hooks(methods.load_method("diloco"))
  >>> s = h.defaults()
  >>> h.period(s), h.overlap_steps(s), h.overlap_backward(s), h.local_step(s)
  (10, 0, False, 'inner')
  """
  where = f"method module {module.__name__}"
  for name in REQUIRED:
    if not callable(getattr(module, name, None)):
      raise ValueError(f"{where} must define {name}() (see experiments/methods/_hooks.py).")
  for name in NAMES:
    if hasattr(module, name) and not callable(getattr(module, name)):
      raise ValueError(f"{where}: {name} must be a function, got {getattr(module, name)!r}.")
  own = [name for name, value in vars(module).items()
         if not name.startswith("_") and inspect.isfunction(value)
         and value.__module__ == module.__name__]
  for name in own:
    if name not in NAMES:
      close = difflib.get_close_matches(name, NAMES, n=1)
      hint = f" Did you mean {close[0]}()?" if close else ""
      raise ValueError(f"{where} defines {name}(), which is no hook of a method; the hooks: "
                       f"{', '.join(NAMES)} (a helper's name starts with '_').{hint}")
  return Hooks(**{name: getattr(module, name) for name in NAMES if hasattr(module, name)})
