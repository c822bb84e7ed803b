"""The methods `experiments.build` can run: one module per method, loaded by name.

Each module defines `defaults()` (its settings, the library factory's defaults read from its
signature) and `build(settings, ctx)` (the optax transform); optionally `wrap_loss` and
`overlap_steps`. See experiments/build.py for the contract; a method of your own is one such
file anywhere (`config.method.name = "/path/to/my_method.py"`).
"""

from __future__ import annotations

import optax


def nesterov(lr: float, momentum: float) -> optax.GradientTransformation:
  """The outer optimiser of DiLoCo-style methods: SGD with Nesterov momentum (plain SGD at
  momentum 0)."""
  if not momentum:
    return optax.sgd(lr)
  return optax.sgd(lr, momentum=momentum, nesterov=True)
