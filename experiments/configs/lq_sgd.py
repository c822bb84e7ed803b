"""LQ-SGD: PowerSGD rank 4 with log-quantised factors (arXiv 2506.17974)."""

from .. import config


def get_config():
  return config.base_config("lq_sgd", rank=4)
