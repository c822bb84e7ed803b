"""experiments/reproduce/diloco.py (DiLoCo, arXiv 2311.08105): the sync periods H swept at 8
workers (`hs`), the worker counts swept (`workers`) at H = `h_fixed` with `per_worker_batch`
sequences per worker per step, and the paper's protocol with `warm_start_steps` > 0 (every
run starts from that many steps of exact DP). DiLoCo's settings are its method module's."""

from ...reproduce import _reproduce


def get_config():
  return _reproduce.base_config(hs=(1, 5, 10, 25, 50), workers=(1, 2, 4, 8), h_fixed=10,
                                per_worker_batch=4)
