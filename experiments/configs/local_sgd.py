"""Local SGD / FedAvg: parameters averaged every 10 steps."""

from experiments import config


def get_config():
  return config.base_config("local_sgd")
