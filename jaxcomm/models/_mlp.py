"""A multilayer perceptron classifier."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class MLP(nn.Module):
  """Dense layers with ReLU, then a linear classifier head.

  >>> import jax, jax.numpy as jnp
  >>> model = MLP(hidden=(32,), num_classes=10)
  >>> params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
  >>> model.apply(params, jnp.zeros((2, 64))).shape
  (2, 10)
  """
  hidden: Sequence[int] = (64,)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    for width in self.hidden:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)


def classifier_loss(model: nn.Module):
  """`loss(params, batch) -> (mean cross-entropy, {'accuracy': ...})` for `{'x', 'y'}` batches.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> model = MLP(hidden=(8,), num_classes=3)
    >>> params = model.init(jax.random.key(0), jnp.zeros((1, 4)))
    >>> batch = {"x": jnp.ones((5, 4)), "y": jnp.zeros(5, jnp.int32)}
    >>> loss, aux = classifier_loss(model)(params, batch)
    >>> loss.shape, sorted(aux)
    ((), ['accuracy'])
  """

  return lambda params, batch: classification_loss(model.apply(params, batch["x"]), batch["y"])


def classification_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, dict]:
  """(mean cross-entropy, {'accuracy': ...}) of logits f32[B, C] against labels i32[B]."""
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def accuracy(model: nn.Module, params, x, y) -> float:
  """Classification accuracy of `params` on arrays `x`, `y` (one device).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> model = MLP(hidden=(8,), num_classes=3)
    >>> params = model.init(jax.random.key(0), jnp.zeros((1, 4)))
    >>> 0.0 <= accuracy(model, params, jnp.ones((5, 4)), jnp.zeros(5, jnp.int32)) <= 1.0
    True
  """
  logits = jax.jit(model.apply)(params, x)
  return float(jnp.mean(jnp.argmax(logits, -1) == y))
