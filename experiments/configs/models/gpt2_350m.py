"""GPT-2 medium's shape: a model preset of experiments/plan.py (`--model=gpt2_350m`)."""

import ml_collections


def get_config():
  return ml_collections.ConfigDict(dict(
      model=dict(name="lm", d_model=1024, num_layers=24, num_heads=16, d_ff=4096,
                 vocab_size=50257),
      data="pydoc", seq_len=1024, batch_per_device=8,
      note=("GPT-2 medium's shape (d 1024, 24 layers, 16 heads, vocab 50257, context "
            "1024); the head is untied: 406.3M parameters, not 354.8M")))
