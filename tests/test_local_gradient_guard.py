"""The local-gradient trap: inside your own shard_map, jax.grad with respect to replicated
parameters returns the SUM over workers (JAX's transpose inserts a psum). Transforms that
need each worker's own gradient refuse such gradients; with comm.varying they run as before.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, local, parallel, sync
from tests import contract

W = 8
TRANSFORMS = {
    "sync.mean": lambda: sync.mean("data"),
    "sync.compressed": lambda: sync.compressed(codecs.identity(), axis_name="data"),
    "sync.powersgd": lambda: sync.powersgd(1, axis_name="data"),
    "local.diloco": lambda: local.diloco(optax.sgd(1.0), optax.sgd(1.0), 1, "data"),
    "local.local_sgd": lambda: local.local_sgd(optax.sgd(1.0), 1, "data"),
    "parallel.zero": lambda: parallel.zero(optax.sgd(1.0), 1, "data"),
}


def _grads_then_update(mesh, tx, vary: bool):
  """Each worker's loss is sum(w * x_w); its gradient w.r.t. w is x_w (x_w = w + 1)."""
  def body(params, x):
    p = comm.varying(params, "data") if vary else params
    grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(p)
    updates, _ = tx.update(grads, tx.init(params), params)
    return comm.varying(updates["w"], "data")[None]  # [1, 2] per worker

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")),
                               out_specs=P("data")))({"w": jnp.ones(2)},
                                                     jnp.repeat(jnp.arange(1.0, W + 1), 2))


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_summed_gradients_are_refused_local_ones_are_averaged(mesh8, name):
  with pytest.raises(ValueError, match=rf"{name}.*same on every worker of \('data',\).*"
                     r"jaxcomm.comm.varying\(params, 'data'\)"):
    _grads_then_update(mesh8, TRANSFORMS[name](), vary=False)
  out = _grads_then_update(mesh8, TRANSFORMS[name](), vary=True)
  # Exact mean of the local gradients 1..8 is 4.5 (sgd(1.0) steps by minus it); the summed
  # gradients would have given 36.
  want = 4.5 if name.startswith("sync") else -4.5
  np.testing.assert_allclose(out, np.full((W, 2), want), rtol=1e-6)  # on every worker


@pytest.mark.parametrize("name", sorted(contract.METHODS))
def test_every_transform_refuses_summed_gradients(mesh8, name):
  """Every row of the one table (tests/contract.py), on the data axis, refuses the summed
  gradients when the step is traced; a wrapper that hands them on, through its inner
  optimiser (a mean here; the others' inner SGD does not look)."""
  method = contract.METHODS[name]
  inner = optax.chain(sync.mean("data"), optax.sgd(1.0)) if method.hands_on else optax.sgd(1.0)
  tx = method.build(inner, "data")
  params = contract.example_params()

  def body(params, x):  # jax.grad with respect to the replicated parameters: a psum
    grads = jax.grad(lambda p: sum(jnp.sum(q * x) for q in jax.tree.leaves(p)))(params)
    return jax.tree.map(lambda u: comm.varying(u, "data")[None],
                        tx.update(grads, tx.init(params), params)[0])

  step = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=(P(), P("data")),
                               out_specs=P("data")))
  with pytest.raises(ValueError, match=r"same on every worker of \('data',\).*"
                                       r"jaxcomm.comm.varying\(params, 'data'\)"):
    step.trace(params, jnp.arange(W, dtype=jnp.float32))


def test_decode_gradient_refuses_summed_gradients(mesh8):
  """The trap as first met: decode_gradient returned 8x the mean."""
  code = sync.fractional_repetition(W, 1)

  def body(params, x, vary):
    p = comm.varying(params, "data") if vary else params
    g = jax.grad(lambda p: jnp.sum(p * x))(p)
    return sync.decode_gradient(g, code, jnp.zeros(W, bool), "data")[0]

  # The two workers of a group hold the same partitions, so their coded gradients agree.
  coded = jnp.array([1.0, 1.0, 3.0, 3.0, 5.0, 5.0, 7.0, 7.0])
  run = lambda vary: jax.shard_map(lambda p, x: body(p, x, vary), mesh=mesh8,
                                   in_specs=(P(), P("data")), out_specs=P())(jnp.ones(1), coded)
  with pytest.raises(ValueError, match="sync.decode_gradient.*comm.varying"):
    run(False)
  np.testing.assert_allclose(run(True), [4.0], rtol=1e-6)  # the mean of the partitions


def test_no_false_alarm_where_nothing_is_tracked(mesh8):
  """vmap with an axis name, and shard_map with check_vma=False, carry no varying types."""
  tx = sync.mean("data")
  step = lambda g: tx.update(g, tx.init(g))[0]
  out = jax.vmap(step, axis_name="data")({"w": jnp.arange(8.0)})
  np.testing.assert_allclose(out["w"], np.full(8, 3.5))
  f = jax.shard_map(step, mesh=mesh8, in_specs=P("data"), out_specs=P("data"), check_vma=False)
  np.testing.assert_allclose(f({"w": jnp.arange(8.0)})["w"], np.full(8, 3.5))
