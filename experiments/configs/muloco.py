"""MuLoCo (arXiv 2505.23725): Muon inside each worker, a sync every H = 30 steps, outer
Nesterov SGD (lr 0.7, momentum 0.9), 2-bit outer gradients with error feedback."""

from .. import config


def get_config():
  return config.base_config("muloco", bits=2, memory="ef")
