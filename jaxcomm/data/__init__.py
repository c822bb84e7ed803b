"""Embedded datasets and user text files, with deterministic per-process batches."""

from jaxcomm.data._datasets import ArrayDataset
from jaxcomm.data._datasets import DATASETS
from jaxcomm.data._datasets import TextDataset
from jaxcomm.data._datasets import digits
from jaxcomm.data._datasets import load
from jaxcomm.data._datasets import pydoc_text
from jaxcomm.data._datasets import stdlib_text
from jaxcomm.data._datasets import text_file
from jaxcomm.data._skew import LabelSkewDataset
from jaxcomm.data._skew import dirichlet_split
from jaxcomm.data._skew import label_skew

__all__ = (
    "ArrayDataset",
    "DATASETS",
    "LabelSkewDataset",
    "TextDataset",
    "digits",
    "dirichlet_split",
    "label_skew",
    "load",
    "pydoc_text",
    "stdlib_text",
    "text_file",
)
