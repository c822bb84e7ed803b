r"""Every codec's speed against its roofline, measured in one run (one device).

  python -m benchmarks.codec_table --config.n=4194304 --config.repeats=7 \
      --out=runs/codec_table.json    # or codec_table.md: the table as markdown

The vector is gradient-like: Gaussian entries times a log-normal magnitude (heavy tails).
The run first measures the two limits of this machine:

* copy bandwidth: the best of a numpy memcpy of the vector and XLA's copy of it (read +
  write, bytes / second);
* matmul throughput: the best of a 1024^3 float32 matmul at HIGHEST precision and the
  [n / 64, 64] x [64, 64] matmul of a 64-point DCT (FLOP / second).

For each codec it then reports the payload bytes, the compression ratio, the relative L2 and
max errors against the codec's stated bound, and two timings, each against its limit:

* `enc+dec`: jitted `encode(x)` plus jitted `decode(payload)`, two programs, so the payload
  is materialised as it is before it travels (one program would fuse a cast's encode into
  its decode and never write the payload). Inputs are donated, so the identity costs
  nothing. Memory limit: the bytes a codec must move, 4n read + P written by encode and P
  read + 4n written by decode (P = payload bytes; 0 for the identity, whose payload is its
  input), over the copy bandwidth. Compute limit (transform codecs only): forward plus
  inverse transform FLOPs over the matmul throughput. Limit = the larger; x = time / limit.
* `EF step`: one update of `sync.compressed(codec, memory="ef", axis_name=None)` on the
  vector (flatten, p = g + e, encode, decode, e <- p - D(C(p)), unflatten), as the
  transform runs it, with the gradient and the state donated. Memory limit: g and e read, e
  and the update written (16n) plus the payload written and read (2P); compute limit as
  above.

Timings are the minimum over `repeats` rounds; within a round every codec is timed in turn
(interleaved, so drift on a shared machine hits all alike) and the bandwidth and matmul
probes are re-timed every round. Donated inputs are fresh copies made outside the timed
call. glibc is told to keep freed memory (`mallopt`): by default it returns a freed heap top
above 32 MB to the system, and every call would then pay page faults for its fresh buffers
(a program with three 16 MB outputs ran 7x slower), which measures the allocator, not the
codec. Run it when the machine is quiet (`uptime`).
"""

from __future__ import annotations

import ctypes
import math
import os
import time
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags
from jax import lax

from experiments import _cli
from experiments import toolkit
from jaxcomm import codecs, sync


def get_config() -> ml_collections.ConfigDict:
  """The benchmark's settings (`--config.<name>=<value>`)."""
  return ml_collections.ConfigDict(dict(
      n=1 << 22,      # vector length
      repeats=7,      # timed rounds (the minimum is reported)
      only=""))       # only codecs whose name contains this text ("": all)


def codecs_to_compare(n: int):
  """(codec, transform FLOPs of encode + decode) for every codec of the table."""
  # DeMo's tiling of one [n / 1024, 1024] matrix (64 x 64 tiles when n / 1024 % 64 == 0).
  shapes = [s for s in [(n // 1024, 1024), (n % 1024,)] if math.prod(s)]
  tiled = codecs.tiled_dct_top_k(shapes, chunk=64, k=32)

  def tiled_flops(_):  # 2-D DCT of an a x b tile: 2ab(a + b) FLOPs each way
    total = 0
    for s in shapes:
      rows, cols = (math.prod(s[:-1]), s[-1])
      a, b = codecs.largest_divisor(rows, 64), codecs.largest_divisor(cols, 64)
      total += 2 * 2 * rows * cols * (a + b)
    return total

  plain = [
      codecs.identity(), codecs.cast("bfloat16"), codecs.cast("float8_e4m3fn"),
      codecs.fp8(block=256), codecs.fp4(block=32), codecs.fp4(block=32, stochastic=True),
      codecs.uniform(8, block=256), codecs.uniform(4, block=256),
      codecs.uniform(4, block=256, symmetric=False),
      codecs.uniform(4, stochastic=True, block=256), codecs.uniform(3, block=256),
      codecs.uniform(2, block=256), codecs.qsgd(7, bucket=512), codecs.qsgd(1, bucket=512),
      codecs.log_quant(4, 10.0, block=256), codecs.sign(block=None), codecs.sign(block=256),
      codecs.top_k(0.01), codecs.top_k(0.01, chunk=256), codecs.random_k(0.01),
      codecs.random_k(0.01, shared_key=False), codecs.rtop_k(0.04, 0.01),
      codecs.rtop_k(0.04, 0.01, order="index"),
  ]
  return ([(c, 0) for c in plain] +
          [(codecs.dct_top_k(chunk=64, k=4), 4 * 64 * n),  # [n/64, 64] x [64, 64], twice
           (codecs.dct_top_k(chunk=64, k=32), 4 * 64 * n), (tiled, tiled_flops(n))])


def _keep_freed_memory() -> None:
  """glibc: never trim the heap nor mmap large blocks (M_TRIM_THRESHOLD, M_MMAP_THRESHOLD)."""
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:  # not glibc: nothing to tune
    return
  libc.mallopt(-1, 1 << 30)
  libc.mallopt(-3, 1 << 30)


def _best(fn, args_fn, repeats: int) -> float:
  """Minimum seconds of `fn(*args_fn())` over `repeats` calls (arguments made untimed)."""
  best = float("inf")
  for _ in range(repeats):
    args = args_fn()
    jax.block_until_ready(args)
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def main(argv):
  del argv
  c = flags.FLAGS.config
  for name in ("n", "repeats"):
    toolkit.int_at_least(c, name, 1)
  _keep_freed_memory()
  # Donation is for the codecs whose payload is their input (identity): the others' payloads
  # have other shapes, and jax says so once per program.
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  n = c.n
  load = os.getloadavg()
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (n,)) * jnp.exp(jax.random.normal(k2, (n,)))
  key = jax.random.key(1)
  x_np, dst = np.asarray(x), np.empty((n,), np.float32)
  copy = jax.jit(lambda v: v * 1.0 + 0.0)  # a real pass over v (XLA folds a bare copy)
  mats = [jax.random.normal(key, (1024, 1024)), jax.random.normal(key, (max(n // 64, 1), 64))]
  dct = jax.random.normal(key, (64, 64))
  hi = lax.Precision.HIGHEST
  matmul_big = jax.jit(lambda a: jnp.matmul(a, a, precision=hi))
  matmul_dct = jax.jit(lambda a: jnp.matmul(a, dct, precision=hi))

  entries = []
  for codec, flops in codecs_to_compare(n):
    if c.only not in codec.name:
      continue
    enc = jax.jit(codec.encode, donate_argnums=0)
    dec = jax.jit(lambda p, key, c=codec: c.decode_with(p, n, key), donate_argnums=0)
    tx = sync.compressed(codec, memory="ef", axis_name=None,
                         key=key if codec.stochastic else None)
    state = tx.init({"g": x})
    ef = jax.jit(tx.update, donate_argnums=(0, 1))
    payload = enc(x + 0.0, key)
    entries.append(dict(codec=codec, flops=flops, enc=enc, dec=dec, payload=payload, ef=ef,
                        state=state, t_enc=float("inf"), t_dec=float("inf"),
                        t_ef=float("inf")))
  t_copy = t_mm = float("inf")
  fresh = lambda: (x + 0.0, key)  # x is donated: a new buffer for every call
  copy_tree = lambda tree: jax.tree.map(lambda a: a.copy(), tree)
  fresh_dec = lambda e: (copy_tree(e["payload"]), key)
  fresh_ef = lambda e: ({"g": x + 0.0}, copy_tree(e["state"]))
  for e in entries:  # compile and warm up
    jax.block_until_ready(e["enc"](*fresh()))
    jax.block_until_ready(e["dec"](*fresh_dec(e)))
    jax.block_until_ready(e["ef"](*fresh_ef(e)))
  for _ in range(c.repeats):
    t_copy = min(t_copy, _best(lambda: np.copyto(dst, x_np), tuple, 3),
                 _best(copy, lambda: (x,), 3))
    t_mm = min(t_mm, _best(matmul_big, lambda: (mats[0],), 1) / (2 * 1024 ** 3),
               _best(matmul_dct, lambda: (mats[1],), 1) / (2 * mats[1].shape[0] * 64 * 64))
    for e in entries:
      e["t_enc"] = min(e["t_enc"], _best(e["enc"], fresh, 1))
      e["t_dec"] = min(e["t_dec"], _best(e["dec"], lambda e=e: fresh_dec(e), 1))
      e["t_ef"] = min(e["t_ef"], _best(e["ef"], lambda e=e: fresh_ef(e), 1))
  bandwidth = 8 * n / t_copy  # bytes read + written per second
  flop_rate = 1.0 / t_mm

  rows = [_row(e, n, x, key, bandwidth, flop_rate) for e in entries]
  head = (f"n = {n:,} float32 ({4 * n:,} bytes), heavy-tailed; {jax.devices()[0].platform}, "
          f"one device; min of {c.repeats} interleaved rounds; load average "
          f"{load[0]:.1f} before, {os.getloadavg()[0]:.1f} after\n"
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write: memcpy of 4n bytes in "
          f"{1e3 * t_copy:.2f} ms); matmul {flop_rate / 1e9:.1f} GFLOP/s")
  print(head + "\n" + _text(rows))
  out = flags.FLAGS.out
  if not (out or "").endswith(".md"):
    _cli.write_json(out, {
        "n": n, "platform": jax.devices()[0].platform, "load_before": load[0],
        "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flop_per_s": flop_rate, "rows": rows})
  else:  # the table as RESULTS.md shows it
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
      f.write(head.replace("\n", "; ") + "\n\n" + _markdown(rows) + "\n")


def _row(e, n, x, key, bandwidth, flop_rate) -> dict:
  """One codec's errors, times and limits (ms) as the table reports them."""
  codec = e["codec"]
  p = codec.payload_bytes(n)
  err = jax.jit(codec.roundtrip)(x, key) - x
  bound = float(jax.jit(codec.error_bound or (lambda v: jnp.inf))(x))
  moved = 0 if codec.name == "identity" else 8 * n + 2 * p
  lim_mem, lim_flop = moved / bandwidth, e["flops"] / flop_rate
  limit, t_rt = max(lim_mem, lim_flop), e["t_enc"] + e["t_dec"]
  lim_ef = max((16 * n + 2 * p) / bandwidth, lim_flop)
  return {"codec": codec.name, "payload_bytes": p, "ratio": codec.ratio(n),
          "rel_l2_error": float(jnp.linalg.norm(err) / jnp.linalg.norm(x)),
          "max_abs_error": float(jnp.max(jnp.abs(err))), "error_bound": bound,
          "encode_ms": 1e3 * e["t_enc"], "decode_ms": 1e3 * e["t_dec"],
          "roundtrip_ms": 1e3 * t_rt, "memory_limit_ms": 1e3 * lim_mem,
          "compute_limit_ms": 1e3 * lim_flop, "roundtrip_x_limit": t_rt / limit if limit else None,
          "ef_step_ms": 1e3 * e["t_ef"], "ef_limit_ms": 1e3 * lim_ef,
          "ef_x_limit": e["t_ef"] / lim_ef}


def _x(v) -> str:
  return "-" if v is None else f"{v:.1f}"


def _text(rows) -> str:
  head = (f"{'codec':<38}{'ratio':>7}{'rel err':>8}{'err/bnd':>8} |{'enc':>7}{'dec':>7}"
          f"{'mem':>7}{'flop':>7}{'x lim':>7} |{'EF step':>8}{'limit':>7}{'x lim':>7}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(
        f"{r['codec']:<38}{r['ratio']:>7.1f}{r['rel_l2_error']:>8.3f}"
        f"{r['max_abs_error'] / r['error_bound'] if r['error_bound'] else 0.0:>8.2f} |"
        f"{r['encode_ms']:>7.2f}{r['decode_ms']:>7.2f}{r['memory_limit_ms']:>7.2f}"
        f"{r['compute_limit_ms']:>7.2f}{_x(r['roundtrip_x_limit']):>7} |{r['ef_step_ms']:>8.2f}"
        f"{r['ef_limit_ms']:>7.2f}{_x(r['ef_x_limit']):>7}")
  return "\n".join(lines)


def _markdown(rows) -> str:
  lines = ["| codec | ratio | encode ms | decode ms | memory limit ms | compute limit ms | "
           "x limit | EF step ms | EF limit ms | x limit |", "|" + "---|" * 10]
  for r in rows:
    lines.append(
        f"| {r['codec']} | {r['ratio']:.1f} | {r['encode_ms']:.2f} | {r['decode_ms']:.2f} | "
        f"{r['memory_limit_ms']:.2f} | {r['compute_limit_ms']:.2f} | "
        f"{_x(r['roundtrip_x_limit'])} | {r['ef_step_ms']:.2f} | {r['ef_limit_ms']:.2f} | "
        f"{_x(r['ef_x_limit'])} |")
  return "\n".join(lines)


if __name__ == "__main__":
  _cli.run(main, get_config(), out=True)
