r"""Compression ratio, error and speed of every codec on one large vector (one CPU device).

  python -m benchmarks.codec_table --n=1000000 --out=runs/codec_table.json

The vector is gradient-like: Gaussian entries times a log-normal magnitude (heavy tails).
For each codec: payload bytes, ratio against float32, relative L2 error ||x - D(C(x))|| / ||x||,
max |error| against the codec's stated bound, and the jitted encode+decode time (the error
bound is computed separately and not timed).
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags

_N = flags.DEFINE_integer("n", 1_000_000, "Vector length.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (best is reported).")
_OUT = flags.DEFINE_string("out", None, "Optional JSON output path.")


def codecs_to_compare():
  from jaxcomm import codecs  # pylint: disable=import-outside-toplevel
  return [
      codecs.identity(), codecs.cast("bfloat16"), codecs.cast("float8_e4m3fn"),
      codecs.fp8(block=256), codecs.fp4(block=32), codecs.uniform(8, block=256),
      codecs.uniform(4, block=256), codecs.uniform(4, block=256, symmetric=False),
      codecs.uniform(4, stochastic=True, block=256), codecs.uniform(2, block=256),
      codecs.qsgd(7, bucket=512), codecs.qsgd(1, bucket=512),
      codecs.log_quant(4, 10.0, block=256), codecs.sign(block=None), codecs.sign(block=256),
      codecs.top_k(0.01), codecs.top_k(0.01, chunk=256), codecs.random_k(0.01),
      codecs.random_k(0.01, shared_key=False), codecs.rtop_k(0.04, 0.01),
      codecs.dct_top_k(chunk=64, k=4), codecs.dct_top_k(chunk=64, k=32),
  ]


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  n = _N.value
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (n,)) * jnp.exp(jax.random.normal(k2, (n,)))
  key = jax.random.key(1)
  rows = []
  print(f"n = {n:,} float32 elements ({4 * n:,} bytes), heavy-tailed; one CPU device")
  print(f"{'codec':<36}{'bytes':>12}{'ratio':>9}{'rel L2 err':>12}{'max err':>10}"
        f"{'bound':>10}{'ms':>9}")
  for codec in codecs_to_compare():
    fn = jax.jit(codec.roundtrip)
    out = jax.block_until_ready(fn(x, key))
    bound = jax.jit(codec.error_bound or (lambda v: jnp.inf))(x)
    best = float("inf")
    for _ in range(_REPEATS.value):
      t = time.perf_counter()
      jax.block_until_ready(fn(x, key))
      best = min(best, time.perf_counter() - t)
    err = out - x
    row = {"codec": codec.name, "payload_bytes": codec.payload_bytes(n),
           "ratio": codec.ratio(n), "linear": codec.linear,
           "rel_l2_error": float(jnp.linalg.norm(err) / jnp.linalg.norm(x)),
           "max_abs_error": float(jnp.max(jnp.abs(err))), "error_bound": float(bound),
           "roundtrip_ms": 1e3 * best}
    rows.append(row)
    print(f"{row['codec']:<36}{row['payload_bytes']:>12,}{row['ratio']:>9.1f}"
          f"{row['rel_l2_error']:>12.4f}{row['max_abs_error']:>10.3g}{row['error_bound']:>10.3g}"
          f"{row['roundtrip_ms']:>9.1f}")
  if _OUT.value:
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump({"n": n, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
