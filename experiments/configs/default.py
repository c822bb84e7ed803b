r"""Any method with the default model and data: `--config=experiments/configs/default.py:NAME`.

NAME is a method of experiments/methods/ (`dp` when omitted), a dotted module path or a
`.py` file of your own (see experiments/build.py), e.g.

  python -m experiments.train --config=experiments/configs/default.py:/tmp/my_method.py \
      --config.method.my_setting=3
"""

from .. import config


def get_config(method: str | None = None):
  return config.base_config(method or "dp")
