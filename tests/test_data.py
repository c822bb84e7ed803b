"""Embedded datasets: deterministic batches, process shares that tile the global batch."""

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
