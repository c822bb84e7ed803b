"""GASLoC (arXiv 2606.11081): inner AdamW, every H = 50 steps each worker's outer step and a
gossip step over a ring, with momentum on the post-step iterates (the accelerated variant)."""

from experiments import config


def get_config():
  return config.base_config("gasloc", sync_every=50, momentum=0.5)
