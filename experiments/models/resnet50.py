"""ResNet-50 (He et al., arXiv 1512.03385, Table 1; bottleneck blocks) on a synthetic image
dataset."""

import ml_collections

from ..toolkit import Task
from . import _resnet


def defaults():
  return ml_collections.ConfigDict()


def build(s, ctx) -> Task:
  del s
  return _resnet.build("resnet50", ctx, stages=(3, 4, 6, 3), block="bottleneck")
