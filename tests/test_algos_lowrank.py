"""--algo=powersgd|lq_sgd|onebit_adam|demo build from the experiment config and train the MLP."""

import numpy as np
import pytest

from experiments import builders
from jaxcomm import sync, train


@pytest.mark.parametrize("algo,extra,lr", [
    ("powersgd", {"rank": 2, "memory": "ef"}, 1e-2),
    ("lq_sgd", {"rank": 2, "bits": 6, "collective": "gather"}, 1e-2),
    ("onebit_adam", {"freeze_step": 4}, 1e-2),
    ("demo", {"chunk": 16, "k": 4, "beta": 0.9}, 3e-3),
])
def test_lowrank_algo_trains_mlp(mesh8, algo, extra, lr):
  cfg = builders.Config(model="mlp", dataset="digits", algo=algo, optimizer="adam", lr=lr,
                        batch_size=64, hidden=(16,), extra=extra)
  tx = builders.make_optimizer(cfg)
  _, loss_fn, params, batch_fn, has_aux = builders.make_task(cfg)
  trainer = train.Trainer(loss_fn, tx, mesh8, has_aux=has_aux)
  _, history = train.fit(trainer, trainer.init(params), batch_fn, 12, log_every=1,
                         progress=False)
  losses = [h["loss"] for h in history]
  assert np.isfinite(losses).all() and np.mean(losses[-3:]) < losses[0], losses
  assert all(h["wire_bytes"] > 0 for h in history)


def test_flags_reach_the_transforms():
  cfg = builders.Config(algo="powersgd", extra={"rank": 3, "memory": "none"})
  state = builders.make_optimizer(cfg).init({"w": np.zeros((64, 64), np.float32)})
  assert isinstance(state[0], sync.PowerSGDState)
  assert state[0].q[0].shape == (1, 64, 3) and state[0].error is None
