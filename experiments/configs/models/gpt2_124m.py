"""GPT-2 small's shape: a model preset of experiments/plan.py (`--model=gpt2_124m`)."""

import ml_collections


def get_config():
  return ml_collections.ConfigDict(dict(
      model=dict(name="lm", d_model=768, num_layers=12, num_heads=12, d_ff=3072,
                 vocab_size=50257),
      data="pydoc", seq_len=1024, batch_per_device=8,
      note=("GPT-2 small's shape (Radford et al. 2019; d 768, 12 layers, 12 heads, vocab "
            "50257, context 1024); the head is untied: 163.1M parameters, not 124.4M")))
