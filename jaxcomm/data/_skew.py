"""Non-identical data: a dataset split across workers by Dirichlet label skew.

Each class's examples are divided among the W workers in proportions drawn from
Dirichlet(alpha, ..., alpha): a small alpha gives each worker a few dominant classes (client
drift becomes visible), a large alpha approaches an identical split. A batch is laid out as
the Trainer shards it: rows [w·B/W, (w+1)·B/W) of the global batch come from worker w's
shard, so each worker trains on its own skewed data.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxcomm import _validate as v
from jaxcomm.data import _validate
from jaxcomm.data._datasets import ArrayDataset, _process_share, _rng


def dirichlet_split(labels: np.ndarray, num_workers: int, alpha: float, *, seed: int = 0,
                    max_tries: int = 100) -> tuple[np.ndarray, ...]:
  """Indices of each worker's shard: per class, Dirichlet(alpha) proportions over workers.

  Redraws (deterministically, from `seed`) until no shard is empty.

  >>> shards = dirichlet_split(np.repeat(np.arange(3), 10), 2, 100.0)
  >>> sorted(np.concatenate(shards).tolist()) == list(range(30))
  True
  """
  num_workers = v.integer("num_workers", num_workers, low=1, high=2**20)
  alpha = v.number("alpha", alpha, low=0.0, low_open=True)
  seed = v.integer("seed", seed, low=0)
  labels = np.asarray(labels)
  if len(labels) < num_workers:
    raise ValueError(f"{len(labels)} examples cannot fill {num_workers} non-empty shards.")
  rng = np.random.default_rng(seed)
  for _ in range(max_tries):
    parts = [[] for _ in range(num_workers)]
    for c in np.unique(labels):
      idx = rng.permutation(np.flatnonzero(labels == c))
      cuts = (np.cumsum(rng.dirichlet(np.full(num_workers, float(alpha)))) * len(idx))
      for w, chunk in enumerate(np.split(idx, cuts.astype(int)[:-1])):
        parts[w].append(chunk)
    shards = tuple(np.sort(np.concatenate(p)) for p in parts)
    if min(len(s) for s in shards) > 0:
      return shards
  raise ValueError(f"could not give every one of {num_workers} workers a non-empty shard "
                   f"with alpha={alpha} in {max_tries} draws; use a larger alpha.")


@dataclasses.dataclass(frozen=True)
class LabelSkewDataset:
  """An `ArrayDataset` split across `num_workers` by Dirichlet label skew."""
  base: ArrayDataset
  shards: tuple        # num_workers arrays of example indices
  alpha: float

  @property
  def num_workers(self) -> int:
    return len(self.shards)

  def label_counts(self) -> np.ndarray:
    """i64[W, num_classes]: how many examples of each class each worker holds."""
    return np.stack([np.bincount(self.base.y[s], minlength=self.base.num_classes)
                     for s in self.shards])

  def batch(self, step: int, batch_size: int, *, seed: int = 0, process_index: int = 0,
            process_count: int = 1) -> dict:
    """Global batch `step`: worker w's B/W rows are sampled from its own shard."""
    _validate.batch_args(step, batch_size, seed, process_index, process_count)
    if batch_size % self.num_workers:
      raise ValueError(f"batch_size ({batch_size}) must be divisible by the number of "
                       f"workers ({self.num_workers}).")
    per = batch_size // self.num_workers
    rng = _rng(seed, step)
    idx = np.concatenate([s[rng.integers(0, len(s), size=per)] for s in self.shards])
    return _process_share({"x": self.base.x[idx], "y": self.base.y[idx]}, batch_size,
                          process_index, process_count)

  def all(self) -> dict:
    return self.base.all()


def label_skew(dataset: ArrayDataset, num_workers: int, alpha: float, *,
               seed: int = 0) -> LabelSkewDataset:
  """Splits `dataset` across `num_workers` workers with Dirichlet(alpha) label skew.

  Args:
    dataset: a labelled `ArrayDataset` (e.g. `digits()`).
    num_workers: W, the size of the data axis the batch is sharded over.
    alpha: concentration > 0; 0.1 is strongly skewed, 100 is nearly identical.
    seed: seed of the split.

  Returns:
    A `LabelSkewDataset` whose `batch` puts worker w's examples in the w-th block of rows.

  References:
    Hsu et al., arXiv 1909.06335 (Dirichlet non-identical splits).

  >>> from jaxcomm import data
  >>> ds = label_skew(data.digits(), num_workers=8, alpha=0.1)
  >>> ds.batch(0, 16)["x"].shape, ds.label_counts().shape
  ((16, 64), (8, 10))
  """
  v.instance("dataset", dataset, ArrayDataset, "labelled ArrayDataset (e.g. data.digits())")
  return LabelSkewDataset(dataset, dirichlet_split(dataset.y, num_workers, alpha, seed=seed),
                          float(alpha))
