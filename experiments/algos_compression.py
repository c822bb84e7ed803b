"""--algo=compressed: gradient compression as codec x error memory x collective.

  python -m experiments.train --algo=compressed --codec=top_k --fraction=0.01 --memory=ef
  python -m experiments.train --algo=compressed --codec=uniform --bits=4 --memory=ef \
      --collective=two_phase --model=mlp

Settings come from `cfg.extra` (train.py's --codec, --memory, --collective, --fraction,
--bits, --chunk flags): codec one of `CODECS`, memory none|ef|ef21|loco, collective
auto|psum|gather|two_phase.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from experiments import builders
from jaxcomm import codecs, sync

# name -> (fraction, bits, chunk) -> Codec
CODECS: dict[str, Callable[..., codecs.Codec]] = {
    "identity": lambda f, b, c: codecs.identity(),
    "bf16": lambda f, b, c: codecs.cast("bfloat16"),
    "fp8": lambda f, b, c: codecs.fp8(block=c or 256),
    "fp4": lambda f, b, c: codecs.fp4(block=c or 32),
    "uniform": lambda f, b, c: codecs.uniform(b, block=c or 256),
    "uniform_sr": lambda f, b, c: codecs.uniform(b, stochastic=True, block=c or 256),
    "qsgd": lambda f, b, c: codecs.qsgd(2 ** (b - 1) - 1, bucket=c or 512),
    "sign": lambda f, b, c: codecs.sign(block=c),
    "log_quant": lambda f, b, c: codecs.log_quant(b, 10.0, block=c or 256),
    "top_k": lambda f, b, c: codecs.top_k(f, chunk=c),
    "random_k": lambda f, b, c: codecs.random_k(f),
    "rtop_k": lambda f, b, c: codecs.rtop_k(min(1.0, 4 * f), f),
    "dct_top_k": lambda f, b, c: codecs.dct_top_k(chunk=c or 64, k=max(1, round(f * (c or 64)))),
}


def make_codec(name: str, fraction: float = 0.01, bits: int = 4,
               chunk: int | None = None) -> codecs.Codec:
  """A codec from its command-line name; `bits` is the code width (qsgd: with the sign bit)."""
  if name not in CODECS:
    raise ValueError(f"codec {name!r} is unknown; allowed: {', '.join(sorted(CODECS))}.")
  return CODECS[name](fraction, bits, chunk)


def make_compressed(extra: dict[str, Any], axis_name: Any, seed: int = 0):
  """The sync.compressed stage described by `extra` (codec, memory, collective, ...)."""
  codec = make_codec(extra.get("codec", "top_k"), extra.get("fraction", 0.01),
                     extra.get("bits", 4), extra.get("chunk"))
  memory = extra.get("memory", "ef")
  collective = extra.get("collective", "auto")
  return sync.compressed(codec, memory=None if memory in (None, "none") else memory,
                         collective=None if collective in (None, "auto") else collective,
                         axis_name=axis_name, key=jax.random.key(seed))


@builders.algorithm("compressed")
def _compressed(cfg: builders.Config, inner: optax.GradientTransformation):
  return optax.chain(make_compressed(cfg.extra, cfg.axis_name, cfg.seed), inner)
