"""The methods `experiments.build` can run: one module per method, loaded by name.

Each module defines `defaults()` (its settings, the library factory's defaults read from its
signature) and `build(settings, ctx)` (the optax transform); optionally `wrap_loss` and
`overlap_steps`. See experiments/build.py for the contract; a method of your own is one such
file anywhere (`config.method.name = "/path/to/my_method.py"`).
"""

from __future__ import annotations

import math
import numbers

import optax


def nesterov(lr: float, momentum: float) -> optax.GradientTransformation:
  """The outer optimiser of DiLoCo-style methods (settings `outer_lr`, `outer_momentum`):
  SGD with Nesterov momentum, plain SGD at momentum 0."""
  if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not 0 < lr < math.inf:
    raise ValueError(f"outer_lr must be a finite number > 0, got {lr!r}.")
  if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or \
     not 0 <= momentum < 1:
    raise ValueError(f"outer_momentum must be a number in [0, 1), got {momentum!r}.")
  if not momentum:
    return optax.sgd(lr)
  return optax.sgd(lr, momentum=momentum, nesterov=True)
