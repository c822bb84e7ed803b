"""The checks behind the datasets' public functions (built on `jaxcomm._validate`)."""

from __future__ import annotations

import glob
import os
from typing import Any, Sequence

from jaxcomm import _validate as v


def dataset_name(name: Any, known: Sequence[str]) -> str:
  """A dataset `load` knows: one of `known` or 'text:<path>' of an existing file."""
  if isinstance(name, str) and name.startswith("text:"):
    if not os.path.isfile(name[len("text:"):]):
      raise ValueError(f"name {name!r}: the text file {name[len('text:'):]!r} does not exist.")
    return name
  if isinstance(name, str) and name in known:
    return name
  raise ValueError(f"name must name a dataset; dataset {name!r} does not exist; allowed: "
                   f"{', '.join(known)}.")


def test_fraction(value: Any) -> float:
  return v.number("test_fraction", value, low=0, high=1, low_open=True, high_open=True)


def seq_len(value: Any, num_tokens: int) -> int:
  """A sequence length that fits the corpus (a window of seq_len + 1 tokens)."""
  return v.integer("seq_len", value, low=1, high=num_tokens - 1)


def batch_args(step: Any, batch_size: Any, seed: Any, process_index: Any,
               process_count: Any) -> None:
  """A global batch (step, size, seed) and this process's share of it."""
  v.integer("step", step, low=0)
  v.integer("seed", seed, low=0)
  batch_size = v.integer("batch_size", batch_size, low=1)
  process_count = v.integer("process_count", process_count, low=1)
  process_index = v.integer("process_index", process_index, low=0, high=process_count - 1)
  if batch_size % process_count:
    raise ValueError(f"batch_size ({batch_size}) must be divisible by the number of "
                     f"processes ({process_count}).")


def text_path(path: Any) -> str:
  if not isinstance(path, str) or not os.path.isfile(path):
    raise ValueError(f"text file {path!r} does not exist.")
  return path


def text_length(path: str, num_bytes: int) -> None:
  if num_bytes < 2:
    raise ValueError(f"text file {path!r} is too short to train on.")


def text_folder(path: Any, pattern: str) -> list[str]:
  """The non-empty, non-hidden files under folder `path` matching `pattern`, sorted."""
  if not isinstance(path, str) or not os.path.isdir(path):
    what = "is not a folder" if isinstance(path, str) and os.path.exists(path) else \
        "does not exist"
    raise ValueError(f"data folder {path!r} {what}.")
  # glob skips hidden files and folders (names starting with a dot).
  files = sorted(f for f in glob.glob(os.path.join(path, pattern), recursive=True)
                 if os.path.isfile(f) and os.path.getsize(f) > 0)
  if not files:
    raise ValueError(f"data folder {path!r} is empty: no non-empty file matches "
                     f"{pattern!r}.")
  return files
