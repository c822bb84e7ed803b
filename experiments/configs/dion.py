"""Dion (arXiv 2504.05295), data parallel by low-rank factors: rank 1/4 of every matrix's
shorter side, lr 0.02 on the matrices, AdamW on the rest."""

from experiments import config


def get_config():
  return config.base_config("dion")
