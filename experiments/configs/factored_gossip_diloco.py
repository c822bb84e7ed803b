"""Factored Gossip DiLoCo (arXiv 2606.22768): inner AdamW, every H = 50 steps a gossip of the
outer parameters over a ring (non-blocking) plus the worker's own outer step, and every 2nd
round a gossip of the outer steps too (blocking)."""

from experiments import config


def get_config():
  return config.base_config("factored_gossip_diloco", sync_every=50, blocking_every=2)
