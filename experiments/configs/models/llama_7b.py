"""Llama 2 7B's shape: a model preset of experiments/plan.py (`--model=llama_7b`)."""

import ml_collections


def get_config():
  return ml_collections.ConfigDict(dict(
      model=dict(name="lm", d_model=4096, num_layers=32, num_heads=32, d_ff=16512,
                 vocab_size=32000),
      data="pydoc", seq_len=4096, batch_per_device=1,
      note=("Llama 2 7B's shape (arXiv 2307.09288; d 4096, 32 layers, 32 heads, vocab "
            "32000, context 4096) with a 2-matrix MLP of width 16512 = 1.5 x 11008 "
            "(SwiGLU's 3 matrices' parameters) and learned positions")))
