"""NoLoCo (arXiv 2506.10911): inner AdamW, every H = 50 steps an outer momentum step averaged
with one random partner; no all-reduce."""

from .. import config


def get_config():
  return config.base_config("noloco", sync_every=50)
