"""TinyLlama-1.1B's shape: a model preset of experiments/plan.py (`--model=llama_1b`)."""

import ml_collections


def get_config():
  return ml_collections.ConfigDict(dict(
      model=dict(name="lm", d_model=2048, num_layers=22, num_heads=32, d_ff=8448,
                 vocab_size=32000),
      data="pydoc", seq_len=2048, batch_per_device=4,
      note=("TinyLlama-1.1B's shape (arXiv 2401.02385; d 2048, 22 layers, 32 heads, vocab "
            "32000, context 2048) with full multi-head attention instead of 4 KV heads and "
            "a 2-matrix MLP of width 8448 = 1.5 x 5632 (SwiGLU's 3 matrices' parameters)")))
