"""DASO-style hierarchy (arXiv 2104.05588): exact all-reduce inside each of 2 groups of 4
devices every step, local SGD across the groups every 10 steps."""

from .. import config


def get_config():
  c = config.base_config("hierarchical")
  c.mesh = "slow=2,fast=4"
  return c
