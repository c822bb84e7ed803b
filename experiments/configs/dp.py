"""Exact data parallelism on the byte-level LM (`--config.method.dtype=bfloat16`: gradients
travel in bfloat16)."""

from .. import config


def get_config():
  return config.base_config("dp")
