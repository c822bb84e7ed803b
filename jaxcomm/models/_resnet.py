"""ResNet-18 for CIFAR-10-shaped inputs (32x32x3, 10 classes)."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn


def _norm(groups: int) -> nn.Module:
  # GroupNorm, not BatchNorm: batch statistics are mutable state outside the parameters that
  # the Trainer does not carry and that would need their own cross-worker reduction; with
  # GroupNorm the model is a pure function of its parameters, so every gradient transform
  # (and its wire bytes) sees exactly the parameters there are.
  return nn.GroupNorm(num_groups=groups)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with a residual; a 1x1 projection when the shape changes."""
  features: int
  strides: int = 1
  groups: int = 8

  @nn.compact
  def __call__(self, x):
    y = nn.Conv(self.features, (3, 3), self.strides, padding=1, use_bias=False)(x)
    y = nn.relu(_norm(self.groups)(y))
    y = nn.Conv(self.features, (3, 3), padding=1, use_bias=False)(y)
    y = _norm(self.groups)(y)
    if self.strides != 1 or x.shape[-1] != self.features:
      x = nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x)
      x = _norm(self.groups)(x)
    return nn.relu(x + y)


class ResNet18(nn.Module):
  """The CIFAR variant of ResNet-18: a 3x3 stem, no max-pool, four stages of two basic blocks
  (64, 128, 256, 512 channels; stride 2 at the start of stages 2-4), global average pooling
  and a linear head. GroupNorm replaces BatchNorm (see `_norm`); `width` scales every stage
  (64 gives the standard 11.2M parameters).

  References:
    He et al., Deep Residual Learning, arXiv 1512.03385.

  >>> import jax, jax.numpy as jnp
  >>> model = ResNet18(width=8, groups=4)
  >>> params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
  >>> jax.eval_shape(model.apply, params, jnp.zeros((2, 32, 32, 3))).shape
  (2, 10)
  """
  num_classes: int = 10
  width: int = 64
  stages: Sequence[int] = (2, 2, 2, 2)
  groups: int = 8

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.width, (3, 3), padding=1, use_bias=False)(x)
    x = nn.relu(_norm(self.groups)(x))
    for i, blocks in enumerate(self.stages):
      for j in range(blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x = BasicBlock(self.width * 2 ** i, strides, self.groups)(x)
    x = x.mean(axis=(1, 2))
    return nn.Dense(self.num_classes)(x)
