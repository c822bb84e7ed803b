"""models.ResNet18: the CIFAR ResNet-18 layout."""

import jax
import jax.numpy as jnp
import pytest

from jaxcomm import models


def test_resnet18_layout_and_parameter_count():
  model = models.ResNet18()
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
  # The CIFAR ResNet-18 (kuangliu/pytorch-cifar, BatchNorm) has 11,173,962 parameters;
  # GroupNorm has the same per-channel scale and bias.
  assert sum(x.size for x in jax.tree.leaves(params)) == 11_173_962
  p = params["params"]
  assert p["Conv_0"]["kernel"].shape == (3, 3, 3, 64)  # 3x3 stem
  assert sum(k.startswith("BasicBlock") for k in p) == 8  # four stages of two blocks
  assert p["Dense_0"]["kernel"].shape == (512, 10)


@pytest.mark.slow
def test_resnet_forward_and_gradient_small():
  # One block per stage, width 4, 8x8 inputs: the same code paths (stem, strided projection
  # blocks, pooling, head) at a fraction of the compile time.
  model = models.ResNet18(width=4, stages=(1, 1, 1, 1), groups=2)
  x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)  # one compile (the gradient) only
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  params = jax.tree.unflatten(treedef, [0.3 * jax.random.normal(k, s.shape) if len(s.shape) > 1
                                        else jnp.ones(s.shape) for k, s in zip(keys, leaves)])
  loss = models.classifier_loss(model)
  (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      params, {"x": x, "y": jnp.array([0, 1])})
  assert jnp.isfinite(value) and 0.0 <= aux["accuracy"] <= 1.0
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_imagenet_resnets_have_torchvision_parameter_counts():
  # torchvision's resnet18 and resnet50 (BatchNorm; GroupNorm has the same scale and bias
  # per channel): 11,689,512 and 25,557,032 parameters.
  x = jnp.zeros((1, 224, 224, 3))
  for model, count in ((models.ResNet(num_classes=1000, stem="imagenet"), 11_689_512),
                       (models.ResNet(num_classes=1000, stages=(3, 4, 6, 3), block="bottleneck",
                                      stem="imagenet"), 25_557_032)):
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    assert sum(p.size for p in jax.tree.leaves(params)) == count
    assert jax.eval_shape(model.apply, params, jnp.zeros((2, 224, 224, 3))).shape == (2, 1000)
