"""One-step delayed update (DPU): the all-reduce of step t overlaps step t + 1."""

from .. import config


def get_config():
  return config.base_config("delayed")
