"""What a training process imports before it trains: nothing heavy that its run does not use.

The suite starts some sixty Python processes (programs, notebook kernels, elastic runs); each
pays its imports again. scikit-learn (SciPy with it: 1.6 s), flax.nnx (0.4 s) and grain
(0.3 s) load only when a run needs them: sklearn never for the digits, which are read from
its file; nnx for an NNX model; grain for `config.data.pipeline = 'grain'`.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("sklearn", "scipy", "flax.nnx", "grain")

# A linen MLP on the digits, built and stepped as experiments/train.py builds it, then the
# heavy modules it loaded.
PROGRAM = """
import sys
from experiments import build, config, train
c = config.base_config("dp")
c.model.name, c.data.name, c.data.batch_size = "mlp", "digits", 8
run = build.build(c)
trainer = run.trainer()
trainer.step(trainer.init(run.params), trainer.shard_batch(run.batches(0)))
print(" ".join(m for m in {heavy} if m in sys.modules))
"""


@pytest.mark.slow
def test_a_linen_run_on_the_digits_imports_no_sklearn_nnx_or_grain():
  result = subprocess.run([sys.executable, "-c", PROGRAM.format(heavy=HEAVY)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
                          env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split() == [], result.stdout
