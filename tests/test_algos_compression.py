"""--algo=compressed builds from the experiment config and trains the MLP and the LM."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import algos_compression, builders
from jaxcomm import comm, data, models, train


def _lm_task(cfg):
  # builders.make_task initialises eagerly (slow for the LM); same model, jitted init.
  lm = models.TransformerLM(d_model=cfg.d_model, num_layers=cfg.num_layers,
                            num_heads=cfg.num_heads, d_ff=cfg.d_ff, max_len=cfg.seq_len)
  params = jax.jit(lm.init)(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))
  ds = data.pydoc_text()
  batch_fn = lambda t: ds.batch(t, cfg.batch_size, seq_len=cfg.seq_len)
  return models.lm_loss(lm), params, batch_fn, False


@pytest.mark.parametrize("model,extra", [
    ("mlp", {"codec": "top_k", "fraction": 0.05, "memory": "ef"}),
    ("lm", {"codec": "uniform", "bits": 4, "memory": "ef", "collective": "two_phase"}),
])
def test_compressed_algo_trains(mesh8, model, extra):
  cfg = builders.Config(model=model, dataset="digits" if model == "mlp" else "pydoc",
                        algo="compressed", optimizer="adam", lr=1e-2, batch_size=32, seq_len=16,
                        d_model=16, num_layers=1, num_heads=2, d_ff=32, hidden=(16,),
                        extra=extra)
  tx = builders.make_optimizer(cfg)
  if model == "mlp":
    _, loss_fn, params, batch_fn, has_aux = builders.make_task(cfg)
  else:
    loss_fn, params, batch_fn, has_aux = _lm_task(cfg)
  trainer = train.Trainer(loss_fn, tx, mesh8, has_aux=has_aux)
  _, history = train.fit(trainer, trainer.init(params), batch_fn, 12, log_every=1,
                         progress=False)
  losses = [h["loss"] for h in history]
  assert np.isfinite(losses).all() and np.mean(losses[-3:]) < losses[0], losses
  codec = algos_compression.make_codec(extra["codec"], extra.get("fraction", 0.01),
                                       extra.get("bits", 4))
  n = sum(x.size for x in jax.tree.leaves(params))
  collective = extra.get("collective", codec.collective)
  assert history[-1]["wire_bytes"] == round(comm.compressed_bytes(codec, n, 8, collective))


def test_every_codec_name_builds_and_bad_names_fail():
  for name in algos_compression.CODECS:
    algos_compression.make_compressed({"codec": name, "memory": "none"}, "data")
  with pytest.raises(ValueError, match="codec"):
    algos_compression.make_codec("zip")
  with pytest.raises(ValueError, match="memory"):
    algos_compression.make_compressed({"codec": "sign", "memory": "ef14"}, "data")
