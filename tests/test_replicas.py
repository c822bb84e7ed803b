"""Every method over replicas of a sharded model: `replica x fsdp x tensor` on 8 devices.

The method synchronises over `replica`; ZeRO-3 (`fsdp`) and tensor parallelism run inside
each replica (`parallel.Layout.optimizer`). Held against references that run the same
method over 2 workers with unsharded copies of the parameters.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, data, local, models, parallel, sync, train

# Every local last dimension on this mesh is a multiple of 8 (the codec block below), so a
# codec's blocks hold the same elements sharded or not (see test_methods_equal_unsharded).
LM = dict(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=8)
MESH = "replica=2,fsdp=2,tensor=2"
R = 2  # replicas


@pytest.fixture(scope="module")
def setup():
  layout = parallel.Layout(parallel.make_mesh(MESH))
  lm = models.TransformerLM(**LM, layout=layout)
  params = models.TransformerLM(**LM).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  specs = layout.param_specs(lm.param_axes(), params)
  mesh2 = parallel.make_mesh({"replica": R}, devices=jax.devices()[:R])
  return layout, lm, params, specs, mesh2


def host(tree):
  return jax.tree.map(np.asarray, tree)


# ---------------------------------------------------------------- methods on given gradients
def linear_loss(scales):
  """loss(p, g) = sum_leaves scale * <p, g[0]>: the gradient of a worker is g, exactly.

  `scales` undo what the layout does to a gradient: ZeRO-3 divides the gradient of a leaf
  sharded over `fsdp` by 2 (it expects the model's reduce-scatter sum), and a leaf
  replicated over `tensor` gets the sum over `tensor` of every device's gradient.
  """
  def loss(p, g):
    terms = jax.tree.map(lambda s, x, y: s * jnp.sum(x * y[0]), scales, p, g)
    return sum(jax.tree.leaves(terms))
  return loss


def layout_scales(layout, specs):
  def scale(spec):
    axes = parallel.spec_axes(spec)
    return ((layout.size("fsdp") if "fsdp" in axes else 1) /
            (1 if "tensor" in axes else layout.size("tensor")))
  return jax.tree.map(scale, specs, is_leaf=lambda s: isinstance(s, P))


def gradients(params, steps):
  """Per step, every replica's gradient: leaves [R, *shape] (float32 normal / 10)."""
  keys = jax.random.split(jax.random.key(1), steps)
  def one(key):
    leaves, treedef = jax.tree.flatten(params)
    ks = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [0.1 * jax.random.normal(k, (R, *x.shape))
                                        for k, x in zip(ks, leaves)])
  return [host(one(k)) for k in keys]


OUTER = lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)
METHODS = {
    "diloco": lambda specs: local.diloco(optax.sgd(0.1), OUTER(), 2, "replica"),
    "streaming_diloco": lambda specs: local.streaming_diloco(
        optax.sgd(0.1), OUTER(), 2, fragments=2, axis_name="replica",
        codec=codecs.fp4(block=4)),
    "powersgd": lambda specs: optax.chain(
        sync.powersgd(2, axis_name="replica", param_specs=specs), optax.sgd(0.1)),
    "compressed_int8_ef": lambda specs: optax.chain(
        sync.compressed(codecs.uniform(8, block=8), memory="ef", axis_name="replica"),
        optax.sgd(0.1)),
}


def run_both(setup, name, steps):
  """(sharded trainer, its state, reference trainer, its state) after `steps` steps."""
  layout, _, params, specs, mesh2 = setup
  grads = gradients(params, steps)
  batch_specs = jax.tree.map(lambda s: P("replica", *s), specs,
                             is_leaf=lambda s: isinstance(s, P))
  sharded = train.Trainer(linear_loss(layout_scales(layout, specs)),
                          layout.optimizer(METHODS[name](specs), specs), layout.mesh,
                          axis_name=layout.batch_axes, param_specs=specs,
                          batch_specs=batch_specs)
  ones = jax.tree.map(lambda _: 1.0, params)
  ref = train.Trainer(linear_loss(ones), parallel.by_sharding(METHODS[name](None), specs),
                      mesh2, axis_name="replica")
  s, r = sharded.init(params), ref.init(params)
  for g in grads:
    s, _ = sharded.step(s, g)
    r, _ = ref.step(r, g)
  return sharded, s, ref, r


@pytest.mark.parametrize("name", list(METHODS))
def test_methods_equal_unsharded(setup, name):
  """Each replica's parameters after 3 syncs equal those of 2 unsharded workers.

  The workers get exactly the same gradients (a linear loss), so what is compared is the
  method under sharding. DiLoCo is element-wise; PowerSGD runs on the whole matrices
  through small inner-axis collectives; the int8 codec quantises the flat vector of this
  device's shards in blocks of 8, and Streaming's fp4 its fragments (every 2nd element) in
  blocks of 4: such blocks hold the same elements as the unsharded ones because every
  shard's last dimension is a multiple of 8 = 4 x 2.
  """
  sharded, s, ref, r = run_both(setup, name, steps=6)
  fsdp = sharded.mesh.shape["fsdp"]
  for replica in range(R):
    got = sharded.worker_view(s.params, sharded.layout.params, replica * fsdp)
    want = ref.worker_view(r.params, ref.layout.params, replica)
    chex.assert_trees_all_close(host(got), host(want), rtol=1e-5, atol=1e-6)
  moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                                           host(want), host(setup[2]))))
  assert moved > 1e-2  # the comparison is not between two unmoved models
