"""Helpers the test files share. The contract checks themselves ship with the package, in
`jaxcomm.testing` (re-exported here for test files written against this module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import codecs, data, models, train
from jaxcomm.testing import check_codec  # noqa: F401
from jaxcomm.testing import check_converges_on_quadratic  # noqa: F401
from jaxcomm.testing import check_jit_state_and_dtypes  # noqa: F401
from jaxcomm.testing import check_on_mesh  # noqa: F401
from jaxcomm.testing import check_transform  # noqa: F401
from jaxcomm.testing import codec_zoo  # noqa: F401
from jaxcomm.testing import example_params  # noqa: F401


def digits_task(num_batches: int):
  """(params, loss, batches): a small MLP on digits with `num_batches` global batches of 64."""
  model = models.MLP(hidden=(16,), num_classes=10)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  ds = data.digits()
  return params, loss, [ds.batch(t, 64) for t in range(num_batches)]


def run_steps(mesh, tx, task, steps=1):
  """(trainer, state, measurements per step) after `steps` Trainer steps of `task`."""
  params, loss, batches = task
  trainer = train.Trainer(loss, tx, mesh)
  state = trainer.init(params)
  ms = []
  for t in range(steps):
    state, m = trainer.step(state, batches[t])
    ms.append(m)
  return trainer, state, ms


def flat(tree):
  """A tree as one float32 numpy vector."""
  return np.asarray(codecs.flatten(tree)[0])
