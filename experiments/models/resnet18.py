"""ResNet-18 (He et al., arXiv 1512.03385, Table 1) on a synthetic image dataset."""

import ml_collections

from ..toolkit import Task
from . import _resnet


def defaults():
  return ml_collections.ConfigDict()


def build(s, ctx) -> Task:
  del s
  return _resnet.build("resnet18", ctx, stages=(2, 2, 2, 2), block="basic")
