"""Embedded datasets and user text files, with deterministic per-process batches; grain
pipelines over them (`batches`: `ds[step]` is this process's share of global batch `step`).

The grain pipelines load on first use (`data.batches`): importing grain costs 0.3 s of every
process's start-up, which a run on the numpy pipeline (the default) does not need.
"""

from typing import TYPE_CHECKING

from jaxcomm.data._datasets import ArrayDataset
from jaxcomm.data._datasets import DATASETS
from jaxcomm.data._datasets import SYNTHETIC_IMAGES
from jaxcomm.data._datasets import SyntheticImages
from jaxcomm.data._datasets import TextDataset
from jaxcomm.data._datasets import digits
from jaxcomm.data._datasets import load
from jaxcomm.data._datasets import pydoc_text
from jaxcomm.data._datasets import stdlib_text
from jaxcomm.data._datasets import synthetic_images
from jaxcomm.data._datasets import text_file
from jaxcomm.data._skew import LabelSkewDataset
from jaxcomm.data._skew import dirichlet_split
from jaxcomm.data._skew import label_skew

__all__ = (
    "ArrayDataset",
    "DATASETS",
    "ExampleSource",
    "LabelSkewDataset",
    "LabelSkewSampler",
    "SYNTHETIC_IMAGES",
    "SyntheticImages",
    "TextDataset",
    "TextWindows",
    "batches",
    "digits",
    "dirichlet_split",
    "label_skew",
    "load",
    "pydoc_text",
    "source",
    "stdlib_text",
    "synthetic_images",
    "text_file",
    "text_folder",
)

_GRAIN = ("ExampleSource", "LabelSkewSampler", "TextWindows", "batches", "source", "text_folder")

if TYPE_CHECKING:
  from jaxcomm.data._grain import ExampleSource
  from jaxcomm.data._grain import LabelSkewSampler
  from jaxcomm.data._grain import TextWindows
  from jaxcomm.data._grain import batches
  from jaxcomm.data._grain import source
  from jaxcomm.data._grain import text_folder


def __getattr__(name: str):
  if name in _GRAIN:
    from jaxcomm.data import _grain  # lazy: grain (see the module docstring)
    return getattr(_grain, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
