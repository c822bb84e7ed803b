"""Embedded datasets and grain pipelines: deterministic batches, process shares that tile
the global batch (one process or two on loopback), folders of text files, label skew."""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxcomm import data


def test_embedded_datasets_load():
  d = data.digits()
  assert d.x.shape == (1797, 64) and d.x.max() <= 1.0 and d.num_classes == 10
  t = data.pydoc_text()
  assert len(t.data) > 400_000
  train, test = t.split(0.1)
  assert len(train.data) + len(test.data) == len(t.data)


def test_digits_read_from_the_file_equal_load_digits_and_so_does_the_fallback(monkeypatch):
  """The file read without importing sklearn (1.6 s) holds load_digits' rows, and where the
  file has moved, load_digits itself gives the same table."""
  from jaxcomm.data import _datasets
  from sklearn.datasets import load_digits
  ref = load_digits()
  want = np.concatenate([ref.data, ref.target[:, None]], axis=1)
  assert _datasets._sklearn_digits_file()  # the file is read: the first path is the one taken
  np.testing.assert_array_equal(_datasets._digits_table(), want)
  monkeypatch.setattr(_datasets, "_sklearn_digits_file", lambda: None)
  np.testing.assert_array_equal(_datasets._digits_table(), want)
  d = data.digits()
  np.testing.assert_array_equal(d.x, (ref.data / 16.0).astype(np.float32))
  np.testing.assert_array_equal(d.y, ref.target)


@pytest.mark.parametrize("ds,kw", [(data.digits(), {}), (data.pydoc_text(), {"seq_len": 16})])
def test_batches_are_deterministic_and_shared_by_processes(ds, kw):
  a, b = ds.batch(3, 8, **kw), ds.batch(3, 8, **kw)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert any(not np.array_equal(a[k], ds.batch(4, 8, **kw)[k]) for k in a)
  shares = [ds.batch(3, 8, process_index=i, process_count=2, **kw) for i in range(2)]
  for k in a:
    np.testing.assert_array_equal(np.concatenate([s[k] for s in shares]), a[k])


def test_text_file_and_errors(tmp_path):
  p = tmp_path / "t.txt"
  p.write_text("hello world, " * 20)
  ds = data.load(f"text:{p}")
  assert ds.batch(0, 2, seq_len=8)["tokens"].shape == (2, 9)
  with pytest.raises(ValueError, match="does not exist"):
    data.load(f"text:{tmp_path}/missing.txt")
  with pytest.raises(ValueError, match="process"):
    ds.batch(0, 3, seq_len=8, process_count=2)


# ---------------------------------------------------------------------- grain pipelines
def test_grain_batch_is_a_pure_function_of_seed_and_step():
  ds = data.batches("pydoc", 8, seq_len=16, seed=0, process_index=0, process_count=1)
  again = data.batches("pydoc", 8, seq_len=16, seed=0, process_index=0, process_count=1)
  np.testing.assert_array_equal(ds[5]["tokens"], again[5]["tokens"])  # no hidden position
  assert not np.array_equal(ds[5]["tokens"], ds[6]["tokens"])
  other = data.batches("pydoc", 8, seq_len=16, seed=1, process_index=0, process_count=1)
  assert not np.array_equal(ds[5]["tokens"], other[5]["tokens"])
  corpus = data.pydoc_text().data
  for row in ds[5]["tokens"]:  # each row is seq_len + 1 consecutive bytes of the corpus
    assert row.dtype == np.int32 and row.shape == (17,)
    starts = np.flatnonzero(corpus[:len(corpus) - 16] == row[0])
    assert any(np.array_equal(corpus[s:s + 17], row) for s in starts)


@pytest.mark.parametrize("count", [2, 4])
def test_grain_process_shares_tile_the_global_batch_and_read_disjoint_records(count):
  class Recording:
    def __init__(self):
      self.source, self.read = data.source("digits"), []

    def __len__(self):
      return len(self.source)

    def __getitem__(self, key):
      self.read.append(key)
      return self.source[key]

  whole = data.batches("digits", 8, seed=2, process_index=0, process_count=1)
  sources = [Recording() for _ in range(count)]
  shares = [data.batches(s, 8, seed=2, process_index=i, process_count=count)
            for i, s in enumerate(sources)]
  for t in range(3):
    parts = [s[t] for s in shares]
    for k in ("x", "y"):
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[t][k])
  reads = [s.read for s in sources]
  assert all(len(r) == 3 * 8 // count for r in reads)  # each reads its own rows only
  # (Distinct global rows map to distinct records within an epoch of 1,797 examples.)
  assert len(set().union(*map(set, reads))) == sum(map(len, reads))


def test_grain_epoch_is_a_permutation_of_every_window(tmp_path):
  (tmp_path / "a.txt").write_bytes(bytes(range(65, 85)))  # 20 bytes + newline
  (tmp_path / "b.md").write_bytes(bytes(range(97, 107)))  # 10 bytes + newline
  source = data.text_folder(str(tmp_path), seq_len=4)
  stream = np.frombuffer(bytes(range(65, 85)) + b"\n" + bytes(range(97, 107)) + b"\n", np.uint8)
  assert len(source) == len(stream) - 4 == 28
  ds = data.batches(source, 4, seed=0, process_index=0, process_count=1)
  rows = np.concatenate([ds[t]["tokens"] for t in range(7)])  # 7 x 4 = one epoch
  windows = np.stack([stream[i:i + 5] for i in range(28)]).astype(np.int32)
  assert sorted(map(tuple, rows)) == sorted(map(tuple, windows))
  second = np.concatenate([ds[t]["tokens"] for t in range(7, 14)])
  assert sorted(map(tuple, second)) == sorted(map(tuple, windows))
  assert not np.array_equal(rows, second)  # each epoch in its own order


def test_grain_folder_errors_name_the_path(tmp_path):
  missing = str(tmp_path / "nowhere")
  with pytest.raises(ValueError, match=f"{missing!r} does not exist"):
    data.text_folder(missing, seq_len=8)
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "blank.txt").write_text("")       # empty files do not count
  (empty / ".hidden.txt").write_text("x" * 100)  # nor do hidden ones
  with pytest.raises(ValueError, match=f"{str(empty)!r} is empty"):
    data.text_folder(str(empty), seq_len=8)
  with pytest.raises(ValueError, match=f"{str(empty)!r} is empty"):
    data.batches(f"folder:{empty}", 8, seq_len=8, process_index=0, process_count=1)
  (empty / "short.txt").write_text("abc")
  with pytest.raises(ValueError, match="fewer than"):
    data.text_folder(str(empty), seq_len=8)
  with pytest.raises(ValueError, match="is not a folder"):
    data.text_folder(str(empty / "short.txt"), seq_len=2)
  with pytest.raises(ValueError, match="dataset"):
    data.batches("imagenet", 8)


def test_label_skew_sampler_is_a_grain_sampler():
  import grain
  source = data.source("digits")
  ds = data.batches(source, 16, seed=1, label_skew=0.1, num_workers=8, process_index=0,
                    process_count=1)
  sampler = data.LabelSkewSampler(source.dataset.y, 8, 0.1, batch_size=16, seed=1)
  loader = grain.DataLoader(data_source=source, sampler=sampler, worker_count=0,
                            operations=[grain.transforms.Batch(16)],
                            shard_options=grain.sharding.NoSharding())
  for t, batch in zip(range(3), loader):
    np.testing.assert_array_equal(batch["x"], ds[t]["x"])
    for w, shard in enumerate(sampler.shards):  # worker w's 2 rows come from its shard
      labels = set(source.dataset.y[shard].tolist())
      assert set(ds[t]["y"][2 * w:2 * w + 2].tolist()) <= labels
  counts = np.stack([np.bincount(source.dataset.y[s], minlength=10) for s in sampler.shards])
  assert (counts.max(1) / counts.sum(1)).mean() > 0.5  # skewed: a dominant class per worker
  with pytest.raises(ValueError, match="labelled"):
    data.batches("pydoc", 16, label_skew=0.1, num_workers=8, process_index=0, process_count=1)


@pytest.mark.slow
def test_two_processes_read_disjoint_shares_whose_union_is_the_one_process_batch(tmp_path):
  """2 processes x 4 devices (jax.distributed on loopback, tests/grain_runner.py)."""
  import grain_runner
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [sys.executable, "-m", "experiments.launch_local", "--processes=2", "--devices=8",
         f"--program={os.path.join(root, 'tests', 'grain_runner.py')}",
         "--heartbeat_timeout=30", "--grace=10", "--", f"--workdir={tmp_path}"]
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=root, env=env,
                          check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  procs = [np.load(tmp_path / f"process{i}.npz") for i in range(2)]
  source = grain_runner.Recording(data.source("pydoc", grain_runner.SEQ))
  one = data.batches(source, grain_runner.BATCH, seed=grain_runner.SEED, process_index=0,
                     process_count=1)
  whole = np.stack([one[t]["tokens"] for t in range(grain_runner.STEPS)])
  half = grain_runner.BATCH // 2
  for i, p in enumerate(procs):
    np.testing.assert_array_equal(p["shares"], whole[:, i * half:(i + 1) * half])
    np.testing.assert_array_equal(p["full"], whole)  # the global array the Trainer sees
  read = [set(p["read"].tolist()) for p in procs]
  assert not read[0] & read[1]
  assert read[0] | read[1] == set(source.read)


def test_grain_splits_hold_out_the_end_of_a_text_and_digits_test_rows():
  corpus = data.pydoc_text().data
  train_, test_ = data.source("pydoc", 16, "train"), data.source("pydoc", 16, "test")
  cut = int(len(corpus) * 0.9)
  assert len(train_) == cut - 16 and len(test_) == len(corpus) - cut - 16
  np.testing.assert_array_equal(test_[0]["tokens"], corpus[cut:cut + 17])
  digits_test = data.source("digits", split="test")
  np.testing.assert_array_equal(digits_test[0]["x"], data.digits().split()[1].x[0])
  with pytest.raises(ValueError, match="split"):
    data.source("pydoc", 16, "validation")
