"""DES-LOC (arXiv 2505.22549): local AdamW; parameters averaged every K_x = 16 steps, Adam's
moments every 3 K_x and 6 K_x (the factory's default ratios)."""

from .. import config


def get_config():
  return config.base_config("des_loc")
