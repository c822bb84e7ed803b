"""ZeRO stage 1 with int8 gradients (per-block scales) and error feedback on the reduce-scatter;
`--config.method.stage=2` for stage 2. Stage 3 is a layout: see layouts.py."""

from .. import config


def get_config():
  return config.base_config("zero", codec="uniform:bits=8", memory="ef")
