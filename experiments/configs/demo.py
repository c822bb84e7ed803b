"""DeMo (arXiv 2411.19870): k = 32 of every 64 x 64 tile of DCT coefficients; a sign update,
so a smaller learning rate than AdamW's."""

from .. import config


def get_config():
  c = config.base_config("demo")
  c.optimizer.lr = 1e-3
  return c
