"""Every public transform factory of jaxcomm.sync, jaxcomm.local and jaxcomm.parallel passes
the contract (as optax's contrib/_common_test.py does for its optimisers).

The list of factories is derived from the subpackages' `__all__` (every public function whose
return annotation is an optax `GradientTransformation...`), so a new factory without an entry
in FACTORIES fails `test_every_public_factory_has_an_entry`. Each entry builds the factory on
one device (`axis_name=None`) and is checked for: `contract.check_transform` (init/update
under jit, no recompilation on a second update, dtypes and state types kept, init on
ShapeDtypeStructs, convergence on a quadratic), a state whose leaves are all arrays, extra
arguments accepted and handed on to the inner optimiser, and the extra-args variant whenever
`update` needs `params`.
"""

from __future__ import annotations

import inspect

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, local, parallel, sync
from tests import contract

MODULES = {"sync": sync, "local": local, "parallel": parallel}


def _stage(tx):
  """A stage that replaces the gradient (no step of its own) becomes an optimiser with SGD."""
  return optax.chain(tx, optax.sgd(0.5))


def _average(params, state, sync):
  """Local SGD's sync rule, for the skeleton's entry."""
  avg, nbytes = local.masked_average(params, sync.mine, sync.total, None)
  return avg, state, nbytes


# name -> (build(inner) -> the factory's transform on one device, as_optimizer(tx)). Factories
# without an inner optimiser ignore `inner` (their extra-args check is only that extra
# arguments are accepted).
FACTORIES = {
    "sync.mean": (lambda inner: sync.mean(None), _stage),
    "sync.compressed": (lambda inner: sync.compressed(codecs.top_k(0.5), memory="ef",
                                                      axis_name=None), _stage),
    "sync.powersgd": (lambda inner: sync.powersgd(1, min_compression_rate=0, axis_name=None),
                      _stage),
    "sync.lq_sgd": (lambda inner: sync.lq_sgd(1, min_compression_rate=0, axis_name=None),
                    _stage),
    "sync.muon": (lambda inner: sync.muon(0.05, axis_name=None), lambda tx: tx),
    "sync.muonbp": (lambda inner: sync.muonbp(0.05, 2, axis_name=None), lambda tx: tx),
    "sync.dion": (lambda inner: sync.dion(0.05, rank=1, axis_name=None), lambda tx: tx),
    "sync.dion2": (lambda inner: sync.dion2(0.05, 0.5, axis_name=None), lambda tx: tx),
    "sync.onebit_adam": (lambda inner: sync.onebit_adam(0.05, freeze_step=20, axis_name=None),
                         lambda tx: tx),
    "sync.demo": (lambda inner: sync.demo(0.02, chunk=4, k=4, axis_name=None), lambda tx: tx),
    "sync.dpsgd": (lambda inner: sync.dpsgd(inner, "ring", num_workers=8, axis_name=None),
                   lambda tx: tx),
    "sync.choco": (lambda inner: sync.choco(inner, "ring", codecs.identity(), num_workers=8,
                                            axis_name=None), lambda tx: tx),
    "sync.gradient_coding": (lambda inner: sync.gradient_coding(
        sync.fractional_repetition(1, 0), axis_name=None), _stage),
    "sync.skip_nonfinite": (lambda inner: sync.skip_nonfinite(inner, axis_name=None),
                            lambda tx: tx),
    "local.acco": (lambda inner: local.acco(inner, None), lambda tx: tx),
    "local.cocodc": (lambda inner: local.cocodc(inner, optax.sgd(1.0), 2, 2, 1, axis_name=None,
                                                codec=None), lambda tx: tx),
    "local.delayed": (lambda inner: local.delayed(inner, None), lambda tx: tx),
    "local.des_loc": (lambda inner: local.des_loc(optax.chain(optax.trace(0.5), inner), 2,
                                                  {"trace": 3}, None), lambda tx: tx),
    "local.diloco": (lambda inner: local.diloco(inner, optax.sgd(1.0), 2, None), lambda tx: tx),
    "local.dreamddp": (lambda inner: local.dreamddp(inner, 2, None), lambda tx: tx),
    "local.factored_gossip_diloco": (lambda inner: local.factored_gossip_diloco(
        inner, optax.sgd(1.0), 2, "ring", num_workers=8, axis_name=None), lambda tx: tx),
    "local.gasloc": (lambda inner: local.gasloc(inner, optax.sgd(1.0), 2, "ring", num_workers=8,
                                                momentum=0.3, axis_name=None), lambda tx: tx),
    "local.pier": (lambda inner: local.pier(inner, 2, None, outer_lr=1.0,
                                            momentum=local.pier_momentum(0.5, 2)),
                   lambda tx: tx),
    "local.hierarchical": (lambda inner: local.hierarchical(inner, 2, None, None),
                           lambda tx: tx),
    "local.local_sgd": (lambda inner: local.local_sgd(inner, 2, None), lambda tx: tx),
    # Outer SGD(1.0): Muon's steps do not shrink near the optimum, and the default outer
    # Nesterov momentum (0.7, 0.9) keeps them oscillating on the quadratic at this lr.
    "local.muloco": (lambda inner: local.muloco(0.05, 2, None, outer=optax.sgd(1.0), bits=4,
                                                block=4, memory="ef"), lambda tx: tx),
    "local.noloco": (lambda inner: local.noloco(inner, 2, None), lambda tx: tx),
    "local.periodic": (lambda inner: local.periodic(inner, 2, _average, axis_name=None),
                       lambda tx: tx),
    "local.scaffold": (lambda inner: local.scaffold(inner, 2, None), lambda tx: tx),
    "local.sparseloco": (lambda inner: local.sparseloco(inner, 2, density=0.5, bits=None,
                                                        axis_name=None), lambda tx: tx),
    "local.stale": (lambda inner: local.stale(inner, 1, None), lambda tx: tx),
    "local.streaming_diloco": (lambda inner: local.streaming_diloco(
        inner, optax.sgd(1.0), 2, fragments=2, axis_name=None, codec=None), lambda tx: tx),
    "parallel.zero": (lambda inner: parallel.zero(inner, 2, None), lambda tx: tx),
    # One group of leaves sharded over `tensor`, one replicated (example_params: w, b).
    "parallel.by_sharding": (lambda inner: parallel.by_sharding(
        inner, {"w": P(None, "tensor"), "b": P()}), lambda tx: tx),
}


def public_factories() -> set[str]:
  """Every public function of sync, local and parallel that returns a GradientTransformation."""
  names = set()
  for prefix, module in MODULES.items():
    for name in module.__all__:
      obj = getattr(module, name)
      if inspect.isfunction(obj) and "GradientTransformation" in str(
          inspect.signature(obj).return_annotation):
        names.add(f"{prefix}.{name}")
  return names


def test_every_public_factory_has_an_entry():
  found = public_factories()
  assert not found - FACTORIES.keys(), (
      f"public transform factories without a contract entry: {sorted(found - FACTORIES.keys())}"
      " -- add one to FACTORIES")
  assert not FACTORIES.keys() - found, f"entries for no factory: {FACTORIES.keys() - found}"


def test_sync_and_local_functions_say_what_they_return():
  # The derivation above reads return annotations: an unannotated public factory would slip.
  for prefix in ("sync", "local"):
    module = MODULES[prefix]
    for name in module.__all__:
      obj = getattr(module, name)
      if inspect.isfunction(obj):
        assert inspect.signature(obj).return_annotation is not inspect.Signature.empty, \
            f"{prefix}.{name} has no return annotation"


def _scaled_sgd(lr: float) -> optax.GradientTransformationExtraArgs:
  """SGD whose update REQUIRES the extra argument `scale` (what a wrapper must hand on)."""
  sgd = optax.sgd(lr)

  def update_fn(updates, state, params=None, *, scale, **extra_args):
    del extra_args
    updates, state = sgd.update(updates, state, params)
    return jax.tree.map(lambda u: u * scale, updates), state

  return optax.GradientTransformationExtraArgs(sgd.init, update_fn)


def _takes_inner(name: str) -> bool:
  module = MODULES[name.split(".")[0]]
  return "inner" in inspect.signature(getattr(module, name.split(".")[1])).parameters


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_contract(name):
  build, as_optimizer = FACTORIES[name]
  tx = build(optax.sgd(0.5))
  params = contract.example_params()
  grads = jax.tree.map(lambda p: 0.3 * p + 0.1, params)
  state = tx.init(params)
  not_arrays = [type(x) for x in jax.tree.leaves(state) if not isinstance(x, jax.Array)]
  assert not not_arrays, f"state leaves that are not jax arrays: {not_arrays}"

  contract.check_transform(as_optimizer(tx))

  # Extra arguments: accepted by every stage (optax.chain passes them to all), and a wrapper
  # hands them on to its inner optimiser.
  optax.with_extra_args_support(tx).update(grads, state, params, scale=2.0)
  if _takes_inner(name):
    wrapped = build(_scaled_sgd(0.5))
    wrapped.update(grads, wrapped.init(params), params, scale=2.0)
    with pytest.raises(TypeError, match="scale"):  # the spy really needs it
      wrapped.update(grads, wrapped.init(params), params)

  # A transform whose update needs params is the extra-args variant (as optax's wrappers).
  try:
    jax.eval_shape(tx.update, grads, state)
    needs_params = False
  except Exception:  # any failure without params means "needs"
    needs_params = True
  if needs_params:
    assert isinstance(tx, optax.GradientTransformationExtraArgs), \
        f"{name} needs params but returns a plain GradientTransformation"
