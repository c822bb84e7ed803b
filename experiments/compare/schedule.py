"""The learning-rate schedule of experiments.compare (config.compare.schedule): where a
schedule-free inner optimiser's held-out loss is read.

`constant` trains with config.optimizer's learning rate. `schedule_free` makes every
method's inner optimiser schedule-free (experiments/build.py; Defazio et al., arXiv
2405.15682): a linear warmup and no decay, so no decay has to end where a link's budget
ends and each trial still trains once for every link. Its held-out loss is read at the
evaluation parameters x, not at the parameters y the gradients are taken at."""

from __future__ import annotations

import jax
import numpy as np
from optax import contrib


def eval_params(params, opt_state):
  """The parameters to evaluate: `params` (y), or with a schedule-free inner optimiser in
  `opt_state` its x = (y - (1 - b1) z) / b1 (`optax.contrib.schedule_free_eval_params`),
  over any leading trial or worker axes its z shares with `params`; a z kept as one flat
  padded vector sharded over workers (a ZeRO-1 inner optimiser, ACCO's) is read as the
  parameters flattened in leaf order (`codecs.flatten`)."""
  free = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
      x, contrib.ScheduleFreeState)) if isinstance(s, contrib.ScheduleFreeState)]
  if not free:
    return params
  b1 = float(np.ravel(np.asarray(free[0].b1))[0])  # the same constant in every trial
  z, ys = free[0].z, jax.tree.leaves(params)
  if len(free) == 1 and jax.tree.structure(z) == jax.tree.structure(params) and all(
      a.shape == b.shape for a, b in zip(jax.tree.leaves(z), ys)):
    return jax.tree.map(lambda y, zi: (y - (1.0 - b1) * np.asarray(zi)) / b1, params, z)
  zs = jax.tree.leaves(z)
  lead = zs[0].ndim - 2 if len(free) == 1 and len(zs) == 1 and zs[0].ndim >= 2 else -1
  if lead < 0 or any(y.shape[:lead] != zs[0].shape[:lead] for y in ys):
    raise ValueError("config.compare.schedule='schedule_free': this method keeps its inner "
                     "optimiser's state in a form whose evaluation parameters cannot be read; "
                     "use schedule='constant'.")
  front = zs[0].shape[:lead]
  y = np.concatenate([np.asarray(v, np.float32).reshape(front + (-1,)) for v in ys], -1)
  x = (y - (1.0 - b1) * np.asarray(zs[0]).reshape(front + (-1,))[..., :y.shape[-1]]) / b1
  ends = np.cumsum([int(np.prod(v.shape[lead:])) for v in ys])[:-1]
  parts = [p.reshape(v.shape).astype(v.dtype) for p, v in zip(np.split(x, ends, -1), ys)]
  return jax.tree.unflatten(jax.tree.structure(params), parts)
