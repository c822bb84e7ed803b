"""Exact data parallelism: every worker steps with the mean gradient (`sync.mean`).

  --config=experiments/configs/dp.py [--config.method.dtype=bfloat16]
"""

import optax

from experiments import config
from jaxcomm import sync


def defaults():
  return config.from_factory(sync.mean, skip=("axis_name",), types={"dtype": str})


def build(settings, ctx):
  return optax.chain(config.call(sync.mean, settings, axis_name=ctx.axis_name), ctx.inner)
