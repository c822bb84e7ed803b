"""PowerSGD rank 4 with error feedback (arXiv 1905.13727)."""

from .. import config


def get_config():
  return config.base_config("powersgd", rank=4)
