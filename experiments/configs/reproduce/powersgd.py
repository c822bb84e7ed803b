"""experiments/reproduce/powersgd.py (PowerSGD, arXiv 1905.13727): the digits MLP trained with
momentum SGD (lr 0.1) for 300 steps at the `ranks`, with and without error feedback, and,
with `table`, ResNet-18's compression table (compiled, not run)."""

from ...reproduce import _reproduce


def get_config():
  c = _reproduce.base_config(ranks=(1, 2, 4), table=True)
  c.steps = 300
  c.model.name, c.data.name = "mlp", "digits"
  c.optimizer.update(name="momentum", lr=0.1)
  return c
