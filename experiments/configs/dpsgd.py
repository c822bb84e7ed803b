"""D-PSGD (arXiv 1705.09056) on a ring of 8 workers, the MLP on digits."""

from .. import config


def get_config():
  c = config.base_config("dpsgd")
  c.model.name, c.data.name = "mlp", "digits"
  c.optimizer.name, c.optimizer.lr = "sgd", 0.1
  return c
