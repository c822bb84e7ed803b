"""Local SGD / FedAvg: parameters averaged every 10 steps."""

from .. import config


def get_config():
  return config.base_config("local_sgd")
