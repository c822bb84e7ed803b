"""grain input pipelines: batch number t of a run is `ds[t]`, a pure function of (seed, t).

`batches(...)` returns a `grain.MapDataset` (random access) whose element t is *this
process's share* of global batch t: rows [p·B/P, (p+1)·B/P) for process p of P, the same
rows whatever the number of processes, so the Trainer assembles the same global batch on
one host or many. Each process reads only the records of its own rows. Resuming needs only
the step (`ds[state.step]`); nothing else of the pipeline has to be saved.

The pipeline, in grain's terms: global example index -> record key (a shuffled index
stream, `MapDataset.range(n).shuffle(seed).repeat()`, each epoch shuffled anew; or the
Dirichlet label-skew sampler, a grain `Sampler`) -> record from a random-access source ->
batch. Sources:

* `ExampleSource`: the rows of an in-memory labelled dataset (`digits`);
* `TextWindows`: every window of `seq_len + 1` consecutive bytes of a corpus, which is an
  in-memory array (`pydoc`, `stdlib`), a memory-mapped file (`text:<path>`) or a folder of
  text files read as one stream (`text_folder`, `folder:<path>`; files are memory-mapped,
  so a process touches only the pages of its own windows).
"""

from __future__ import annotations

import bisect
import os
import sys
from typing import Any

import grain
import jax
import numpy as np

from jaxcomm import _validate as v
from jaxcomm.data import _validate
from jaxcomm.data._datasets import ArrayDataset, digits, pydoc_text, stdlib_text
from jaxcomm.data._skew import dirichlet_split

NAMES = ("digits", "pydoc", "stdlib", "text:<file>", "folder:<path>")
SPLITS = ("all", "train", "test")
TEST_FRACTION = 0.1  # of a text corpus, held out at its end (as TextDataset.split)


class ExampleSource:
  """A grain random-access source over a labelled `ArrayDataset`: record i is {x, y} row i.

  >>> ExampleSource(digits())[0]["x"].shape
  (64,)
  """

  def __init__(self, dataset: ArrayDataset):
    self.dataset = dataset

  def __len__(self) -> int:
    return len(self.dataset.y)

  def __getitem__(self, i: int) -> dict:
    return {"x": self.dataset.x[i], "y": self.dataset.y[i]}


class FolderStream:
  """The files of a folder as one byte stream (sorted paths, each followed by a newline).

  Files are memory-mapped: reading a slice touches only the pages it covers.
  """

  def __init__(self, path: str, pattern: str = "**/*"):
    self.path = path
    self.files = _validate.text_folder(path, pattern)
    self._maps = [np.memmap(f, np.uint8, mode="r") for f in self.files]
    sizes = [len(m) + 1 for m in self._maps]  # + the newline between files
    self._starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()

  def __len__(self) -> int:
    return self._starts[-1]

  def __getitem__(self, sl: slice) -> np.ndarray:
    start, stop, _ = sl.indices(len(self))
    out, pos = [], start
    while pos < stop:
      f = bisect.bisect_right(self._starts, pos) - 1
      local, end = pos - self._starts[f], min(stop, self._starts[f + 1])
      piece = np.asarray(self._maps[f][local:end - self._starts[f]])
      if end == self._starts[f + 1]:  # the newline after the file
        piece = np.concatenate([piece, np.array([10], np.uint8)])
      out.append(piece)
      pos = end
    return np.concatenate(out) if out else np.zeros(0, np.uint8)


class TextWindows:
  """A grain random-access source: record i is `{'tokens': i32[seq_len + 1]}` from byte i.

  Args:
    stream: the corpus bytes: a u8 array, a memory map, or a `FolderStream`.
    seq_len: tokens per training sequence (each record holds seq_len + 1 for the shift).
    name: what the source is called in errors.
    start, stop: the byte range of the stream the windows lie in (a split).

  >>> TextWindows(np.frombuffer(b"abcdef", np.uint8), seq_len=2)[1]["tokens"].tolist()
  [98, 99, 100]
  """

  def __init__(self, stream: Any, seq_len: int, name: str = "text", *, start: int = 0,
               stop: int | None = None):
    self.stream, self.name = stream, name
    self.start, self.stop = start, len(stream) if stop is None else stop
    self.seq_len = _validate.seq_len(seq_len, self.stop - self.start)

  def __len__(self) -> int:
    return self.stop - self.start - self.seq_len

  def __getitem__(self, i: int) -> dict:
    i += self.start
    return {"tokens": np.asarray(self.stream[i:i + self.seq_len + 1], np.int32)}


def text_folder(path: str, seq_len: int, *, pattern: str = "**/*") -> TextWindows:
  """Windows of `seq_len + 1` bytes over a folder of text files (see `FolderStream`).

  Args:
    path: the folder; every non-hidden file matching `pattern` (recursively) is read.
    seq_len: tokens per sequence.
    pattern: a glob pattern relative to `path` (e.g. `"*.txt"`).

  Raises:
    ValueError: the folder does not exist, has no non-empty file, or is shorter than one
      window; the message names the path.

  >>> import os, tempfile
  >>> folder = tempfile.mkdtemp()
  >>> _ = open(os.path.join(folder, "a.txt"), "w").write("hello world " * 10)
  >>> source = text_folder(folder, seq_len=8)
  >>> len(source), source[0]["tokens"].shape
  (113, (9,))
  """
  stream = FolderStream(path, pattern)
  if len(stream) < seq_len + 2:
    raise ValueError(f"data folder {path!r} holds {len(stream)} bytes, fewer than the "
                     f"seq_len + 2 = {seq_len + 2} one training window needs.")
  return TextWindows(stream, seq_len, name=path)


def source(name: str, seq_len: int = 64, split: str = "all") -> Any:
  """A grain random-access source by name: 'digits', 'pydoc', 'stdlib', 'text:<file>' or
  'folder:<path>' (text sources yield windows of `seq_len + 1` tokens).

  `split` is "all", or the dataset's own "train" / "test" split: for text the first 90% /
  last 10% of the bytes, for digits `ArrayDataset.split()` (80% / 20%, fixed seed).

  >>> len(source("digits")), source("pydoc", seq_len=16)[0]["tokens"].shape
  (1797, (17,))
  >>> len(source("digits", split="test"))
  359
  """
  if not (isinstance(name, str) and (name in NAMES[:3] or name.startswith(("text:", "folder:")))):
    raise ValueError(f"dataset {name!r} does not exist; allowed: {', '.join(NAMES)}.")
  v.one_of("split", split, SPLITS)
  if name == "digits":
    dataset = digits()
    return ExampleSource(dataset if split == "all" else dataset.split()[SPLITS.index(split) - 1])
  if name in ("pydoc", "stdlib"):
    stream = (pydoc_text() if name == "pydoc" else stdlib_text()).data
  elif name.startswith("folder:"):
    stream = text_folder(name[len("folder:"):], seq_len).stream
  else:
    path = _validate.text_path(name[len("text:"):])
    _validate.text_length(path, os.path.getsize(path))
    stream = np.memmap(path, np.uint8, mode="r")
  cut = int(len(stream) * (1 - TEST_FRACTION))  # as TextDataset.split
  start, stop = {"all": (0, len(stream)), "train": (0, cut), "test": (cut, len(stream))}[split]
  return TextWindows(stream, seq_len, name, start=start, stop=stop)


def _seed32(*entropy: int) -> int:
  """A 32-bit seed (grain's range) mixed from several integers."""
  return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


class LabelSkewSampler:
  """A grain `Sampler`: global batches whose worker blocks come from Dirichlet label shards.

  Global index i is row i mod B of batch i // B; rows [w·B/W, (w+1)·B/W) are worker w's and
  are drawn from worker w's shard (`dirichlet_split`), which is read epoch after epoch,
  each in its own shuffled order. Works with `grain.DataLoader(sampler=...)` and with
  `batches(..., label_skew=alpha)`.

  Args:
    labels: i32[N] labels of the source's records.
    num_workers: W, the data axis size.
    alpha: Dirichlet concentration (> 0; small is skewed).
    batch_size: B, the global batch size (a multiple of W).
    seed: seed of the split and of the shards' orders.

  >>> sampler = LabelSkewSampler(np.repeat(np.arange(4), 25), 2, 0.1, batch_size=8)
  >>> keys = [sampler[i].record_key for i in range(8)]
  >>> set(keys[:4]) <= set(sampler.shards[0].tolist()), len(sampler.shards)
  (True, 2)
  """

  def __init__(self, labels: Any, num_workers: int, alpha: float, *, batch_size: int,
               seed: int = 0):
    self.shards = dirichlet_split(labels, num_workers, alpha, seed=seed)
    self.batch_size = v.integer("batch_size", batch_size, low=1)
    if batch_size % num_workers:
      raise ValueError(f"batch_size ({batch_size}) must be divisible by the number of "
                       f"workers ({num_workers}).")
    self._orders = [grain.MapDataset.range(len(s)).shuffle(seed=_seed32(seed, w)).repeat()
                    for w, s in enumerate(self.shards)]

  def __len__(self) -> int:
    return sys.maxsize

  def __getitem__(self, index: int) -> grain.RecordMetadata:
    step, row = divmod(index, self.batch_size)
    per = self.batch_size // len(self.shards)
    worker, k = divmod(row, per)
    key = self.shards[worker][self._orders[worker][step * per + k]]
    return grain.RecordMetadata(index=index, record_key=int(key), rng=None)


class _Record:
  """Element j of process p's stream: record `keys[g]` of global element g, where g is
  row p·share + j % share of global batch j // share. A class rather than a lambda: grain
  pickles the pipeline when it prefetches in worker processes."""

  def __init__(self, keys, records, batch_size: int, share: int, process_index: int):
    self.keys, self.records = keys, records
    self.batch_size, self.share, self.process_index = batch_size, share, process_index

  def __call__(self, j: int) -> Any:
    step, row = divmod(j, self.share)
    return self.records[self.keys[step * self.batch_size + self.process_index * self.share
                                  + row]]


class _SamplerKeys:
  """A sampler's record keys as a sequence (what `_Record` reads)."""

  def __init__(self, sampler):
    self.sampler = sampler

  def __getitem__(self, index: int) -> int:
    return self.sampler[index].record_key


def batches(data: Any, batch_size: int, *, seq_len: int = 64, split: str = "all", seed: int = 0,
            label_skew: float | None = None, num_workers: int | None = None,
            process_index: int | None = None,
            process_count: int | None = None) -> grain.MapDataset:
  """This process's share of every global batch, as a grain `MapDataset` indexed by step.

  Args:
    data: a dataset name (see `source`) or a grain random-access source (`len`, `[i]`).
    batch_size: B, the global batch size (a multiple of the process count).
    seq_len: tokens per sequence, for text sources given by name.
    split: "all", "train" or "test" (see `source`), for sources given by name.
    seed: seed of the shuffle (and of the label-skew split).
    label_skew: Dirichlet alpha: split a labelled source across `num_workers` workers with
      `LabelSkewSampler` (None: one shuffled stream).
    num_workers: the data axis size W (with `label_skew`).
    process_index, process_count: this process and how many (default: JAX's).

  Returns:
    `ds` with `ds[t]` = rows [p·B/P, (p+1)·B/P) of global batch t as numpy arrays:
    `{'tokens': i32[B/P, seq_len + 1]}` or `{'x': f32[B/P, D], 'y': i32[B/P]}`.

  >>> ds = batches("pydoc", 8, seq_len=16, seed=0, process_index=0, process_count=1)
  >>> ds[3]["tokens"].shape
  (8, 17)
  >>> half = batches("pydoc", 8, seq_len=16, seed=0, process_index=1, process_count=2)
  >>> bool((half[3]["tokens"] == ds[3]["tokens"][4:]).all())
  True
  """
  records = source(data, seq_len, split) if isinstance(data, str) else data
  if process_index is None or process_count is None:
    process_index, process_count = jax.process_index(), jax.process_count()
  _validate.batch_args(0, batch_size, seed, process_index, process_count)
  if label_skew is None:
    keys = grain.MapDataset.range(len(records)).shuffle(seed=_seed32(seed)).repeat()
  else:
    if not isinstance(records, ExampleSource):
      raise ValueError(f"label_skew needs a labelled source (e.g. 'digits'), got {data!r}.")
    keys = _SamplerKeys(LabelSkewSampler(
        records.dataset.y, v.integer("num_workers", num_workers, low=1), label_skew,
        batch_size=batch_size, seed=seed))
  share = batch_size // process_count
  return (grain.MapDataset.range(sys.maxsize)
          .map(_Record(keys, records, batch_size, share, process_index))
          .batch(share, drop_remainder=True))
