"""Dion2 (arXiv 2512.16928): Newton-Schulz on a quarter of each matrix's rows or columns
(the largest by L1 norm), lr 0.02 on the matrices, AdamW on the rest."""

from experiments import config


def get_config():
  return config.base_config("dion2")
