"""Asynchronous SGD with a delay of 2 updates, DC-ASGD compensated (arXiv 1609.08326)."""

from .. import config


def get_config():
  return config.base_config("stale", delay=2, compensation="dc")
