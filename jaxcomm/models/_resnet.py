"""ResNets: ResNet-18 for CIFAR-10-shaped inputs (32x32x3, 10 classes), and the ImageNet
ResNet-18 and ResNet-50 (224x224x3, 1000 classes) as `ResNet` shapes."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn

from jaxcomm import _validate as v


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


class Bottleneck(nn.Module):
  """1x1 reduce, 3x3 (strided), 1x1 expand to 4 x `features`, with a residual (ResNet-50's
  block; the stride on the 3x3 convolution, as torchvision's ResNet v1.5)."""
  features: int
  strides: int = 1
  groups: int = 8

  @nn.compact
  def __call__(self, x):
    y = nn.relu(_norm(self.groups)(nn.Conv(self.features, (1, 1), use_bias=False)(x)))
    y = nn.Conv(self.features, (3, 3), self.strides, padding=1, use_bias=False)(y)
    y = nn.relu(_norm(self.groups)(y))
    y = _norm(self.groups)(nn.Conv(4 * self.features, (1, 1), use_bias=False)(y))
    if self.strides != 1 or x.shape[-1] != 4 * self.features:
      x = nn.Conv(4 * self.features, (1, 1), self.strides, use_bias=False)(x)
      x = _norm(self.groups)(x)
    return nn.relu(x + y)


STEMS = ("cifar", "imagenet")
BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(nn.Module):
  """A ResNet: a stem, four stages of residual blocks (64, 128, 256, 512 base channels;
  stride 2 at the start of stages 2-4), global average pooling and a linear head. GroupNorm
  replaces BatchNorm (see `_norm`; the parameter count is the same).

  Attributes:
    num_classes: outputs of the head.
    width: base channels of the first stage (64 gives the standard sizes).
    stages: blocks per stage: (2, 2, 2, 2) ResNet-18, (3, 4, 6, 3) ResNet-50 with
      `block="bottleneck"`.
    block: "basic" (two 3x3 convolutions) or "bottleneck" (1x1, 3x3, 1x1 x4).
    stem: "cifar" (a 3x3 convolution, no pooling: 32x32 inputs) or "imagenet" (a 7x7 stride-2
      convolution and a 3x3 stride-2 max-pool: 224x224 inputs).
    groups: GroupNorm groups.

  References:
    He et al., Deep Residual Learning, arXiv 1512.03385.

  >>> import jax, jax.numpy as jnp
  >>> resnet50 = ResNet(num_classes=1000, stages=(3, 4, 6, 3), block="bottleneck",
  ...                   stem="imagenet")
  >>> params = jax.eval_shape(resnet50.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
  >>> sum(x.size for x in jax.tree.leaves(params))  # torchvision's resnet50: 25,557,032
  25557032
  """
  num_classes: int = 10
  width: int = 64
  stages: Sequence[int] = (2, 2, 2, 2)
  block: str = "basic"
  stem: str = "cifar"
  groups: int = 8

  def __post_init__(self):
    v.one_of("block", self.block, BLOCKS)
    v.one_of("stem", self.stem, STEMS)
    super().__post_init__()

  @nn.compact
  def __call__(self, x):
    if self.stem == "imagenet":
      x = nn.Conv(self.width, (7, 7), 2, padding=3, use_bias=False)(x)
      x = nn.relu(_norm(self.groups)(x))
      x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    else:
      x = nn.Conv(self.width, (3, 3), padding=1, use_bias=False)(x)
      x = nn.relu(_norm(self.groups)(x))
    block = BLOCKS[self.block]
    for i, blocks in enumerate(self.stages):
      for j in range(blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x = block(self.width * 2 ** i, strides, self.groups)(x)
    x = x.mean(axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


class ResNet18(ResNet):
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
