"""Embedded datasets and user text files, with deterministic per-process batches; grain
pipelines over them (`batches`: `ds[step]` is this process's share of global batch `step`)."""

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
from jaxcomm.data._grain import ExampleSource
from jaxcomm.data._grain import LabelSkewSampler
from jaxcomm.data._grain import TextWindows
from jaxcomm.data._grain import batches
from jaxcomm.data._grain import source
from jaxcomm.data._grain import text_folder
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
