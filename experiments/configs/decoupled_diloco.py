"""Decoupled DiLoCo (arXiv 2604.21428) with the method's defaults: every learner in every
quorum at equal speeds (Streaming DiLoCo's numbers); set `speeds`, `quorum`, `grace_steps`
to see learners that do not wait."""

from experiments import config


def get_config():
  return config.base_config("decoupled_diloco")
