"""SparseLoCo (arXiv 2508.15706): top-k 2 % per chunk, 2-bit values, error feedback."""

from .. import config


def get_config():
  return config.base_config("sparseloco")
