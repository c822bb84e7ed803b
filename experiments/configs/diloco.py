"""DiLoCo (arXiv 2311.08105): inner AdamW, outer Nesterov SGD (lr 0.7, momentum 0.9), a sync
every H = 50 steps."""

from .. import config


def get_config():
  return config.base_config("diloco", sync_every=50)
