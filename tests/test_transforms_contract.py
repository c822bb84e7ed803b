"""Every public transform factory of jaxcomm.sync, jaxcomm.local and jaxcomm.parallel passes
the contract (as optax's contrib/_common_test.py does for its optimisers).

The list of factories is derived from the subpackages' `__all__` (every public function whose
return annotation is an optax `GradientTransformation...`), so a new factory without a row in
the one table of the test suites, `tests/contract.py`'s METHODS, fails
`test_every_public_factory_has_an_entry`. Each row builds the factory on one device
(`axis_name=None`) and is checked for: `contract.check_transform` (init/update
under jit, no recompilation on a second update, dtypes and state types kept, init on
ShapeDtypeStructs, convergence on a quadratic), a state whose leaves are all arrays, extra
arguments accepted and handed on to the inner optimiser, and the extra-args variant whenever
`update` needs `params`. Each of a row's variants (other settings) passes `check_transform`.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxcomm import local, parallel, sync
from tests import contract

MODULES = {"sync": sync, "local": local, "parallel": parallel}


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
  table = contract.METHODS.keys()
  assert not found - table, (
      f"public transform factories without a contract entry: {sorted(found - table)}"
      " -- add one line to METHODS in tests/contract.py")
  assert not table - found, f"entries for no factory: {table - found}"


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


def _keeps_mixed_dtypes(tx):
  """A tree of a float32 matrix and a bfloat16 scalar keeps each leaf's dtype (read from
  shapes only)."""
  mixed = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.array(0.5, jnp.bfloat16)}
  updates, _ = jax.eval_shape(lambda p: tx.update(p, tx.init(p), p), mixed)
  assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(lambda p: p.dtype, mixed)


@pytest.mark.parametrize("name", sorted(contract.METHODS))
def test_contract(name):
  method = contract.METHODS[name]
  build = lambda inner: method.build(inner, None)
  as_optimizer = (lambda tx: optax.chain(tx, optax.sgd(0.5))) if method.stage else (lambda tx: tx)
  tx = build(optax.sgd(0.5))
  params = contract.example_params()
  grads = jax.tree.map(lambda p: 0.3 * p + 0.1, params)
  state = tx.init(params)
  not_arrays = [type(x) for x in jax.tree.leaves(state) if not isinstance(x, jax.Array)]
  assert not not_arrays, f"state leaves that are not jax arrays: {not_arrays}"

  contract.check_transform(as_optimizer(tx))
  _keeps_mixed_dtypes(tx)

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


@pytest.mark.parametrize("name", sorted(contract.variants()))
def test_contract_of_every_variant(name):
  setting = contract.variants()[name]
  tx = setting.make()
  not_arrays = [type(x) for x in jax.tree.leaves(tx.init(contract.example_params()))
                if not isinstance(x, jax.Array)]
  assert not not_arrays, f"state leaves that are not jax arrays: {not_arrays}"
  contract.check_transform(tx, steps=setting.steps)
  _keeps_mixed_dtypes(tx)
