"""MuonBP (arXiv 2510.16981): block-local Newton-Schulz on 4 of every 5 steps, the whole
matrix on the 5th; lr 0.02 on the matrices, AdamW on the rest."""

from experiments import config


def get_config():
  return config.base_config("muonbp")
