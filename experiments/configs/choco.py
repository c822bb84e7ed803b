"""CHOCO-SGD (arXiv 1902.00340) on a ring, bfloat16 gossip, the MLP on digits."""

from .. import config


def get_config():
  c = config.base_config("choco", consensus_step=0.5)
  c.model.name, c.data.name = "mlp", "digits"
  c.optimizer.name, c.optimizer.lr = "sgd", 0.1
  return c
