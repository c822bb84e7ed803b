"""ACCO (arXiv 2406.02613): estimate and real rounds over a ZeRO-1 sharded AdamW."""

from .. import config


def get_config():
  return config.base_config("acco")
