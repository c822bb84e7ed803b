"""ImageNet ResNet-50: a model preset of experiments/plan.py (`--model=resnet50`)."""

import ml_collections


def get_config():
  return ml_collections.ConfigDict(dict(
      model=dict(name="resnet50"),
      data="synthetic:imagenet", seq_len=1, batch_per_device=32,
      note=("ImageNet ResNet-50 (arXiv 1512.03385; v1.5 strides, 25.6M parameters) with "
            "GroupNorm for BatchNorm; 32 images per device as in Goyal et al. "
            "(arXiv 1706.02677)")))
