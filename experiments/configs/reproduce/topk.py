"""experiments/reproduce/topk.py (top-k with and without memory, Stich et al. 2018): the
digits MLP trained with plain SGD (lr 0.5) for 300 steps, each worker sending the top
`fractions` of its gradient."""

from ...reproduce import _reproduce


def get_config():
  c = _reproduce.base_config(fractions=(0.01, 0.1))
  c.steps = 300
  c.model.name, c.data.name = "mlp", "digits"
  c.optimizer.update(name="sgd", lr=0.5)
  return c
