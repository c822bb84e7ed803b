"""jaxcomm: communication-efficient distributed training for JAX.

Subpackages: `codecs` (what travels), `comm` (how it travels, and what it costs), `sync`
(every-step gradient synchronisation), `local` (when it travels), `parallel` (layouts),
`models`, `data`, `train`, `elastic` (training on while processes die and rejoin), `sim`,
`plan` (real model sizes, compiled but never allocated); `testing` holds the contract
checks every codec and transform passes, for your own tests.
"""

import importlib.metadata

from jaxcomm import codecs
from jaxcomm import comm
from jaxcomm import data
from jaxcomm import elastic
from jaxcomm import local
from jaxcomm import models
from jaxcomm import parallel
from jaxcomm import plan
from jaxcomm import sim
from jaxcomm import sync
from jaxcomm import testing
from jaxcomm import train

try:
  __version__ = importlib.metadata.version("jaxcomm")  # the installed package's version
except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
  __version__ = "0+unknown"

__all__ = (
    "codecs",
    "comm",
    "data",
    "elastic",
    "local",
    "models",
    "parallel",
    "plan",
    "sim",
    "sync",
    "testing",
    "train",
)
