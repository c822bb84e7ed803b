"""experiments/reproduce/demo.py (DeMo, arXiv 2411.19870): the DCT coefficients kept per tile
of up to 64 x 64 (`ks`, the paper's 32 among them) and DeMo's learning rate (`demo_lr`, sign
updates; exact DP keeps AdamW's)."""

from ...reproduce import _reproduce


def get_config():
  return _reproduce.base_config(ks=(128, 32, 8), demo_lr=1e-3)
