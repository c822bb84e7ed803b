"""SCAFFOLD (arXiv 1910.06378) on label-skewed digits, where control variates matter."""

from .. import config


def get_config():
  c = config.base_config("scaffold")
  c.model.name, c.data.name, c.data.label_skew = "mlp", "digits", 0.5
  c.optimizer.name, c.optimizer.lr = "sgd", 0.1
  return c
