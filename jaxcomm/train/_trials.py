"""Populations of trials: each trial's own PRNG keys in a state stacked over trials."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KEY_FIELD = "key"  # the state field in which stochastic stages keep their raw key data


def _is_key_data(path, x) -> bool:
  return any(getattr(k, "name", None) == KEY_FIELD for k in path) and \
      x.dtype == jnp.uint32 and x.shape[-1:] == jax.random.key_data(jax.random.key(0)).shape


def _fold(keys: jax.Array, seed: jax.Array) -> jax.Array:
  """Every key of an array of typed keys folded with `seed`."""
  flat = keys.reshape(-1)
  return jax.vmap(lambda k: jax.random.fold_in(k, seed))(flat).reshape(keys.shape)


def fold_in_trials(tree: Any, seeds: Any) -> Any:
  """Gives each trial its own PRNG keys: trial t's keys become `fold_in(key, seeds[t])`.

  A transform built with `key=...` keeps that key in its state, so `Trainer(trials=S).init`
  (which vmaps `optimizer.init`) gives every trial the same key. This folds each trial's
  seed into every key of a state stacked over trials: typed key leaves, and raw key data
  (uint32, JAX's default implementation) in a state field named `key`, where jaxcomm's
  stochastic stages keep theirs. Keys shared by the workers of a trial stay shared (the
  same seed is folded into every worker's copy), so a shared-key codec stays linear. Other
  leaves are returned as they are; the shardings are kept.

  Args:
    tree: a state with a leading trial axis on every leaf (e.g. `TrainState.opt_state`).
    seeds: one integer seed per trial (shape (trials,)).

  Returns:
    The tree with every key of trial t folded with `seeds[t]`.

  >>> import jax, jax.numpy as jnp
  >>> from typing import NamedTuple
  >>> class S(NamedTuple):
  ...   key: jax.Array
  >>> keys = jnp.stack([jax.random.key_data(jax.random.key(0))] * 2)  # two trials, one key
  >>> out = fold_in_trials(S(keys), jnp.array([1, 2]))
  >>> bool((out.key[1] == jax.random.key_data(
  ...     jax.random.fold_in(jax.random.key(0), 2))).all())
  True
  """
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return tree
  seeds = jnp.asarray(seeds)
  trials = np.shape(leaves[0])[0] if np.ndim(leaves[0]) else None
  if seeds.shape != (trials,) or not jnp.issubdtype(seeds.dtype, jnp.integer):
    raise ValueError(f"seeds must be one integer per trial (shape ({trials},)), got "
                     f"shape {seeds.shape} and dtype {seeds.dtype}.")

  def fold_trial(path, x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.vmap(_fold)(x, seeds)
    if _is_key_data(path, x):
      keys = jax.random.wrap_key_data(x)
      return jax.random.key_data(jax.vmap(_fold)(keys, seeds))
    return x

  # The state keeps its layout (per-worker leaves stay sharded over their workers).
  on_device = all(isinstance(x, jax.Array) for x in leaves)
  shardings = jax.tree.map(lambda x: x.sharding, tree) if on_device else None
  fold = jax.jit(lambda t: jax.tree_util.tree_map_with_path(fold_trial, t),
                 out_shardings=shardings)
  return fold(tree)
