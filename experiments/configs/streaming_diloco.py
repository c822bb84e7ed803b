"""Streaming DiLoCo (arXiv 2501.18512): 2 fragments, each merged 2 inner steps after it is
sent, outer gradients in 4-bit floats (the factory's "auto" codec)."""

from .. import config


def get_config():
  return config.base_config("streaming_diloco", fragments=2, overlap=2)
