"""experiments/reproduce/streaming.py (Streaming DiLoCo, arXiv 2501.18512): 160 inner steps,
`h` inner steps between two syncs of the same fragment, `fragments` P, and the paper-like
run's `overlap` (steps between sending and merging)."""

from ...reproduce import _reproduce


def get_config():
  c = _reproduce.base_config(h=20, fragments=4, overlap=1)
  c.steps = 160
  return c
