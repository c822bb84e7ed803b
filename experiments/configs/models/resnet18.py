"""ImageNet ResNet-18: a model preset of experiments/plan.py (`--model=resnet18`)."""

import ml_collections


def get_config():
  return ml_collections.ConfigDict(dict(
      model=dict(name="resnet18"),
      data="synthetic:imagenet", seq_len=1, batch_per_device=32,
      note=("ImageNet ResNet-18 (arXiv 1512.03385; 224x224x3, 1000 classes, 11.7M "
            "parameters) with GroupNorm for BatchNorm")))
