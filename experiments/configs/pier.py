"""Pier (arXiv 2511.17849): DiLoCo (inner AdamW, H = 50, outer Nesterov lr 0.7) whose outer
momentum warms up to 0.9 over the first 10 outer steps."""

from experiments import config


def get_config():
  return config.base_config("pier", sync_every=50)
