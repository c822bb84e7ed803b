"""DreamDDP (arXiv 2502.11058): one layer group synced per step, each layer every 10 steps."""

from .. import config


def get_config():
  return config.base_config("dreamddp")
