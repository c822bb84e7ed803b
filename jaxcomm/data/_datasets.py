"""Embedded datasets: nothing is downloaded at run time.

* `digits`: scikit-learn's 8x8 handwritten digits (1,797 images, ships with scikit-learn).
* `pydoc`: byte-level text of Python's pydoc topics (~465 KB, ships with Python).
* `stdlib`: byte-level text of the Python standard library's sources (several MB).
* `text:<path>`: any user text file, byte level.
* `synthetic:imagenet`, `synthetic:cifar10`: random images and labels of those datasets'
  shapes (224x224x3 and 1000 classes; 32x32x3 and 10), generated per batch: for throughput
  runs and plans at image-model sizes (nothing learnable; the datasets do not ship here).

Batches are a pure function of `(seed, step)`: batch t is the same whatever the number of
processes or whether the run was resumed, and each process takes its contiguous share of
the global batch (`process_index`, `process_count`). Resuming needs only the step number.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.util
import os
import sysconfig
from typing import Any

import numpy as np

from jaxcomm import _validate as v
from jaxcomm.data import _validate

#: name -> (image shape, classes) of the synthetic image datasets.
SYNTHETIC_IMAGES = {"synthetic:imagenet": ((224, 224, 3), 1000),
                    "synthetic:cifar10": ((32, 32, 3), 10)}
#: The dataset names `load` takes: the embedded ones, a text file of one's own and the
#: synthetic images.
DATASETS = ("digits", "pydoc", "stdlib", "text:<path>", *SYNTHETIC_IMAGES)


def _rng(seed: int, step: int) -> np.random.Generator:
  return np.random.default_rng([seed, step])


def _process_share(batch: dict, global_batch: int, process_index: int, process_count: int):
  n = global_batch // process_count
  return {k: x[process_index * n:(process_index + 1) * n] for k, x in batch.items()}


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
  """A supervised dataset of feature vectors `x` and integer labels `y`."""
  name: str
  x: np.ndarray   # f32[N, D]
  y: np.ndarray   # i32[N]
  num_classes: int

  def split(self, test_fraction: float = 0.2, seed: int = 0):
    """Deterministic (train, test) split."""
    _validate.test_fraction(test_fraction)
    order = np.random.default_rng(seed).permutation(len(self.y))
    n_test = int(round(len(self.y) * test_fraction))
    pick = lambda idx, tag: ArrayDataset(f"{self.name}/{tag}", self.x[idx], self.y[idx],
                                         self.num_classes)
    return pick(order[n_test:], "train"), pick(order[:n_test], "test")

  def batch(self, step: int, batch_size: int, *, seed: int = 0, process_index: int = 0,
            process_count: int = 1) -> dict:
    """Global batch number `step` (sampled with replacement), this process's share."""
    _validate.batch_args(step, batch_size, seed, process_index, process_count)
    idx = _rng(seed, step).integers(0, len(self.y), size=batch_size)
    return _process_share({"x": self.x[idx], "y": self.y[idx]}, batch_size,
                          process_index, process_count)

  def all(self) -> dict:
    return {"x": self.x, "y": self.y}


@dataclasses.dataclass(frozen=True)
class TextDataset:
  """A byte-level text corpus; tokens are bytes (vocabulary 256)."""
  name: str
  data: np.ndarray  # u8[N]
  vocab_size: int = 256

  def split(self, test_fraction: float = 0.1, seed: int = 0):
    """(train, test): the last `test_fraction` of the bytes is held out."""
    del seed
    _validate.test_fraction(test_fraction)
    cut = int(len(self.data) * (1 - test_fraction))
    return (TextDataset(f"{self.name}/train", self.data[:cut]),
            TextDataset(f"{self.name}/test", self.data[cut:]))

  def batch(self, step: int, batch_size: int, *, seq_len: int = 64, seed: int = 0,
            process_index: int = 0, process_count: int = 1) -> dict:
    """Global batch `step`: `tokens` i32[B, seq_len + 1] from random offsets."""
    _validate.batch_args(step, batch_size, seed, process_index, process_count)
    _validate.seq_len(seq_len, len(self.data))
    starts = _rng(seed, step).integers(0, len(self.data) - seq_len - 1, size=batch_size)
    tokens = self.data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return _process_share({"tokens": tokens}, batch_size, process_index, process_count)


@dataclasses.dataclass(frozen=True)
class SyntheticImages:
  """Random images (standard normal) and uniform labels of a fixed shape, generated per batch
  (nothing is stored): row i of global batch `step` depends only on (seed, salt, step, i), so
  each process generates only its share.

  >>> ds = synthetic_images("synthetic:cifar10")
  >>> b = ds.batch(0, 4)
  >>> b["x"].shape, b["y"].shape, ds.num_classes
  ((4, 32, 32, 3), (4,), 10)
  """
  name: str
  shape: tuple      # (H, W, C) of one image
  num_classes: int
  salt: int = 0     # tells the test split's rows from the train split's

  def split(self, test_fraction: float = 0.2, seed: int = 0):
    """(train, test): two independent streams (the data is random either way)."""
    del seed
    _validate.test_fraction(test_fraction)
    return (dataclasses.replace(self, name=f"{self.name}/train", salt=1),
            dataclasses.replace(self, name=f"{self.name}/test", salt=2))

  def batch(self, step: int, batch_size: int, *, seed: int = 0, process_index: int = 0,
            process_count: int = 1) -> dict:
    """Global batch `step`, this process's share: x f32[B/P, H, W, C], y i32[B/P]."""
    _validate.batch_args(step, batch_size, seed, process_index, process_count)
    n = batch_size // process_count
    rows = [np.random.default_rng([seed, self.salt, step, process_index * n + i])
            for i in range(n)]
    x = np.stack([r.standard_normal(self.shape, np.float32) for r in rows]) if rows else \
        np.zeros((0, *self.shape), np.float32)
    y = np.array([r.integers(0, self.num_classes) for r in rows], np.int32)
    return {"x": x, "y": y}


def synthetic_images(name: str) -> SyntheticImages:
  """The synthetic image dataset `name` (a key of `SYNTHETIC_IMAGES`).

  >>> ds = synthetic_images("synthetic:imagenet")
  >>> ds.shape, ds.num_classes
  ((224, 224, 3), 1000)
  """
  v.one_of("name", name, SYNTHETIC_IMAGES)
  shape, classes = SYNTHETIC_IMAGES[name]
  return SyntheticImages(name, shape, classes)


@functools.lru_cache(maxsize=None)
def digits() -> ArrayDataset:
  """scikit-learn's digits: x f32[1797, 64] in [0, 1], y i32[1797], 10 classes.

  Example:
    >>> ds = digits()
    >>> ds.x.shape, ds.batch(0, 4)["x"].shape
    ((1797, 64), (4, 64))
  """
  table = _digits_table()
  return ArrayDataset("digits", (table[:, :-1] / 16.0).astype(np.float32),
                      table[:, -1].astype(np.int32), 10)


def _digits_table() -> np.ndarray:
  """f64[1797, 65]: scikit-learn's digits file (64 pixels in 0..16, then the label).

  Read straight from the file scikit-learn ships, as `load_digits` reads it: importing
  sklearn.datasets costs 1.6 s (SciPy), and every training process on digits would pay it.
  Where the file is not where it used to be, `load_digits` itself.
  """
  path = _sklearn_digits_file()
  if path:
    with gzip.open(path, "rt") as f:
      return np.loadtxt(f, delimiter=",")
  from sklearn.datasets import load_digits  # lazy: heavy (SciPy), only where the file moved
  d = load_digits()
  return np.concatenate([d.data, d.target[:, None]], axis=1)


def _sklearn_digits_file() -> str | None:
  """The digits file in the installed scikit-learn, found without importing it; else None."""
  spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
  folders = spec.submodule_search_locations if spec else None
  for folder in folders or ():
    path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
    if os.path.isfile(path):
      return path
  return None


@functools.lru_cache(maxsize=None)
def pydoc_text() -> TextDataset:
  """Python's pydoc topics (the text behind `help('topics')`), as bytes.

  Example:
    >>> pydoc_text().batch(0, 2, seq_len=16)["tokens"].shape
    (2, 17)
  """
  from pydoc_data.topics import topics  # lazy: a large text table, only this dataset
  text = "\n\n".join(topics[k] for k in sorted(topics))
  return TextDataset("pydoc", np.frombuffer(text.encode("utf-8"), np.uint8))


@functools.lru_cache(maxsize=None)
def stdlib_text(max_bytes: int = 8 << 20) -> TextDataset:
  """The standard library's Python sources (sorted, deterministic), up to `max_bytes`.

  Example:
    >>> len(stdlib_text(max_bytes=1000).data) <= 1000
    True
  """
  root = sysconfig.get_paths()["stdlib"]
  chunks, total = [], 0
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests",
                                                           "__pycache__"))
    for f in sorted(filenames):
      if f.endswith(".py") and total < max_bytes:
        with open(os.path.join(dirpath, f), "rb") as fh:
          chunks.append(fh.read())
        total += len(chunks[-1])
  data = np.frombuffer(b"\n".join(chunks)[:max_bytes], np.uint8)
  return TextDataset("stdlib", data)


def text_file(path: str) -> TextDataset:
  """A user's text file, byte level.

  Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "t.txt")
    >>> _ = open(path, "w").write("hello world " * 20)
    >>> ds = text_file(path)
    >>> ds.batch(0, 2, seq_len=8)["tokens"].shape
    (2, 9)
  """
  _validate.text_path(path)
  with open(path, "rb") as fh:
    data = np.frombuffer(fh.read(), np.uint8)
  _validate.text_length(path, len(data))
  return TextDataset(os.path.basename(path), data)


def load(name: str) -> Any:
  """A dataset by name: 'digits', 'pydoc', 'stdlib', 'text:<path>' or a synthetic image
  dataset ('synthetic:imagenet', 'synthetic:cifar10').

  >>> load("digits").x.shape
  (1797, 64)
  """
  _validate.dataset_name(name, DATASETS)
  if name == "digits":
    return digits()
  if name == "pydoc":
    return pydoc_text()
  if name == "stdlib":
    return stdlib_text()
  if name in SYNTHETIC_IMAGES:
    return synthetic_images(name)
  return text_file(name[len("text:"):])
