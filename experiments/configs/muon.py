"""Muon (optax.contrib.muon's rule), data parallel: lr 0.02 on the matrices, AdamW on the
rest; owner-based orthogonalisation of sharded matrices."""

from .. import config


def get_config():
  return config.base_config("muon")
