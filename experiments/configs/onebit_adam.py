"""1-bit Adam (arXiv 2102.02888): exact Adam for the first 100 steps, then 1-bit momentum."""

from .. import config


def get_config():
  c = config.base_config("onebit_adam")
  c.optimizer.lr = 1e-3
  return c
