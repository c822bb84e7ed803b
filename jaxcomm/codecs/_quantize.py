"""Quantisers: a few bits per element plus float32 scales per block.

All of them are non-linear (each worker's scales differ, so codes cannot be summed) and
prefer the two-phase all-reduce, where a reduced chunk re-encodes to the size of a worker's.
Codes travel packed (`pack_bits`), scales as float32, one or two per block. Stochastic
rounding draws its uniforms from `_random` (counter-based: one fused pass, where threefry
cost ten times the quantiser); grids are found by compares and decoded by select trees, so
encode and decode are single vectorised passes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _validate as v
from jaxcomm.codecs import _random
from jaxcomm.codecs._base import Codec
from jaxcomm.codecs._bits import (F32_SLACK, block_sizes, blocks, check_bits, check_block,
                                  num_blocks, pack_bits, packed_bytes, unblock, unpack_bits)

_F32 = jnp.float32


def _need_key(key: Any, name: str):
  if key is None:
    raise ValueError(f"{name} is stochastic: encode needs a PRNG key, got key=None.")


def _round(v: jax.Array, key: Any, stochastic: bool) -> jax.Array:
  """Nearest rounding, or stochastic rounding floor(v + u) (unbiased: E = v).

  u is uniform on [0, 1) from `_random.uniform` (counter-based: one fused pass).
  """
  if not stochastic:
    return jnp.round(v)
  return jnp.floor(v + _random.uniform(key, v.shape))


def _rank(v: jax.Array, edges, strict: bool = False) -> jax.Array:
  """int32: how many static `edges` are <= v (< v if strict): a sum of compares, fused."""
  out = jnp.zeros(v.shape, jnp.int32)
  for e in edges:
    out = out + ((v > e) if strict else (v >= e)).astype(jnp.int32)
  return out


def _lookup(index: jax.Array, table) -> jax.Array:
  """float32 table[index] for a static table: up to 16 entries a binary tree of selects on
  the index bits (one fused pass: log2(size) bit tests, size - 1 selects; XLA:CPU runs a
  gather element by element), a gather beyond."""
  if len(table) > 16:
    return jnp.asarray(table, _F32)[index]
  depth = max(1, math.ceil(math.log2(len(table))))
  level = [jnp.asarray(_F32(v)) for v in table] + [jnp.asarray(_F32(table[-1]))] * (
      2 ** depth - len(table))
  index = index.astype(jnp.uint32)
  for bit in range(depth):  # pairs differing in this bit, lowest bit first
    take_odd = ((index >> bit) & 1) == 1
    level = [jnp.where(take_odd, hi, lo) for lo, hi in zip(level[0::2], level[1::2])]
  return jnp.broadcast_to(level[0], index.shape)


def _amax(x, block):
  xb, _ = blocks(jnp.abs(x), block)
  return jnp.max(xb, axis=1)


def _safe(s):
  return jnp.where(s > 0, s, 1.0)


def uniform(bits: int = 8, *, stochastic: bool = False, block: int | None = None,
            symmetric: bool = True) -> Codec:
  """int-N: uniform levels with a float32 scale per block.

  Symmetric (default): levels k * scale for k in -L..L, L = 2**(bits-1) - 1 and scale = the
  block's largest magnitude / L, so zero is exact (most gradient entries are near zero).
  Asymmetric (`symmetric=False`): the block's [min, max] in 2**bits - 1 equal steps (two floats
  per block; allows bits=1). Codes travel packed (ceil(n * bits / 8) bytes). With
  `stochastic=True` the rounding is stochastic, which makes the codec unbiased.

  Args:
    bits: code width, 1..16 (2..16 when symmetric).
    stochastic: stochastic rounding (needs a key) instead of round-to-nearest.
    block: elements per scale block; None for one block over the whole vector.
    symmetric: levels symmetric around an exact zero, or spanning [min, max].

  Returns:
    A `Codec`; error bound step/2 (nearest) or step (stochastic) per block.

  >>> c = uniform(2, block=4)  # levels -s, 0, s
  >>> c.roundtrip(jnp.array([0., 1., -1., 0.2, 10., 20., 30., -40.]))
  Array([  0.,   1.,  -1.,   0.,   0.,  40.,  40., -40.], dtype=float32)
  >>> c.payload_bytes(8)  # 8 codes of 2 bits, one scale per block
  10
  """
  bits = check_bits(bits)
  block = check_block(block)
  if symmetric and bits < 2:
    raise ValueError("bits must be >= 2 for a symmetric grid (-L..L); use symmetric=False "
                     "(levels min and max) or codecs.sign() for 1 bit.")
  levels = 2 ** (bits - 1) - 1 if symmetric else 2 ** bits - 1
  name = (f"uniform({bits}{', stochastic' if stochastic else ''}, block={block}"
          f"{'' if symmetric else ', asymmetric'})")

  def grid(x):
    """Blocks, mask, the value of code 0 and the step per block."""
    xb, valid = blocks(x, block)
    if symmetric:
      step = jnp.max(jnp.abs(xb), axis=1) / levels
      return xb, valid, -levels * step, step
    # min and max of the real elements: pad with the last one (it is in the last block)
    # instead of masking the padding, so the reductions read nothing but the blocks.
    n = x.shape[0]
    edge = blocks(jnp.pad(x, (0, xb.size - n), mode="edge"), block)[0] if n else xb
    lo, hi = jnp.min(edge, axis=1), jnp.max(edge, axis=1)
    return xb, valid, lo, (hi - lo) / levels

  def encode(x, key):
    if stochastic:
      _need_key(key, "uniform(stochastic=True)")
    xb, _, lo, step = grid(x)
    v = (xb - lo[:, None]) / _safe(step)[:, None]
    top = 2 * levels if symmetric else levels
    q = jnp.clip(_round(v, key, stochastic), 0, top).astype(jnp.uint32)
    scales = (step,) if symmetric else (lo, step)
    return (pack_bits(unblock(q, x.shape[0]), bits),) + scales

  def decode(p, n):
    codes, step = p[0], p[-1]
    lo = -levels * step if symmetric else p[1]
    q, _ = blocks(unpack_bits(codes, bits, n).astype(_F32), block)
    return unblock(lo[:, None] + q * step[:, None], n)

  def error_bound(x):
    _, _, _, step = grid(x)
    return jnp.max(step) * (1.0 if stochastic else 0.5) + F32_SLACK * jnp.max(jnp.abs(x))

  def variance_bound(x):
    _, valid, _, step = grid(x)
    return jnp.sum(jnp.sum(valid, axis=1) * step ** 2 / 4)

  scale_bytes = 4 if symmetric else 8
  return Codec(name, encode, decode,
               payload_bytes=lambda n: packed_bytes(n, bits) + scale_bytes * num_blocks(n, block),
               stochastic=stochastic, error_bound=error_bound, unbiased=stochastic,
               variance_bound=variance_bound if stochastic else None, collective="two_phase")


def qsgd(levels: int = 7, *, bucket: int | None = 512) -> Codec:
  """QSGD: per bucket, norm * sign(v_i) * xi_i with xi_i stochastic on {0, 1/s, .., 1}.

  Each element travels as a sign bit and a level in 0..s (1 + ceil(log2(s + 1)) bits,
  packed); each bucket's L2 norm as float32. Unbiased; E||Q(v) - v||^2 <=
  min(d/s^2, sqrt(d)/s) ||v||^2 per bucket of d elements.

  Args:
    levels: s, the number of positive levels (1 .. 2**15 - 1).
    bucket: elements per norm bucket; None for one bucket.

  Returns:
    A stochastic, unbiased `Codec`.

  References:
    Alistarh et al., QSGD: Communication-Efficient SGD via Gradient Quantization and
    Encoding, arXiv 1610.02132.

  >>> c = qsgd(levels=1, bucket=None)
  >>> c.roundtrip(jnp.array([3., 0., -4.]), jax.random.key(0))
  Array([ 5.,  0., -5.], dtype=float32)
  """
  s = v.integer("levels", levels, low=1, high=2 ** 15 - 1)  # 1 sign bit + at most 15 bits
  bucket = check_block(bucket, "bucket")
  level_bits = max(1, math.ceil(math.log2(s + 1)))
  bits = 1 + level_bits

  def norms(x):
    xb, valid = blocks(x, bucket)
    return xb, valid, jnp.sqrt(jnp.sum(xb * xb, axis=1))

  def encode(x, key):
    _need_key(key, "qsgd")
    xb, _, norm = norms(x)
    r = jnp.abs(xb) / _safe(norm)[:, None] * s
    q = jnp.clip(_round(r, key, True), 0, s).astype(jnp.uint32)
    code = q | ((xb < 0).astype(jnp.uint32) << level_bits)
    return (pack_bits(unblock(code, x.shape[0]), bits), norm)

  def decode(p, n):
    codes, norm = p
    code = unpack_bits(codes, bits, n)
    mag = (code & ((1 << level_bits) - 1)).astype(_F32)
    val = jnp.where((code >> level_bits) == 1, -mag, mag) / s
    vb, _ = blocks(val, bucket)
    return unblock(vb * norm[:, None], n)

  def error_bound(x):
    return jnp.max(norms(x)[2]) / s * (1 + F32_SLACK)

  def variance_bound(x):
    _, valid, norm = norms(x)
    d = jnp.sum(valid, axis=1).astype(_F32)
    return jnp.sum(jnp.minimum(d / s ** 2, jnp.sqrt(d) / s) * norm ** 2)

  return Codec(f"qsgd({s}, bucket={bucket})", encode, decode,
               payload_bytes=lambda n: packed_bytes(n, bits) + 4 * num_blocks(n, bucket),
               stochastic=True, error_bound=error_bound, unbiased=True,
               variance_bound=variance_bound, collective="two_phase")


def sign(*, block: int | None = None) -> Codec:
  """1 bit per element: sign(x) * mean|x| per block (EF-signSGD's scaled sign).

  Payload: sign bits packed 8 per byte (1 for x >= 0) and a float32 scale per block.
  Use it with error feedback (`memory="ef"`): alone it is biased.

  References:
    Bernstein et al., signSGD, arXiv 1802.04434; Karimireddy et al., Error Feedback Fixes
    SignSGD, arXiv 1901.09847.

  >>> sign().roundtrip(jnp.array([1., -2., 3., -6.]))
  Array([ 3., -3.,  3., -3.], dtype=float32)
  """
  block = check_block(block)

  def scales(x):
    xb, _ = blocks(jnp.abs(x), block)
    return xb, jnp.sum(xb, axis=1) / block_sizes(x.shape[0], block)

  def encode(x, key):
    del key
    _, scale = scales(x)
    return (pack_bits((x >= 0).astype(jnp.uint32), 1), scale)

  def decode(p, n):
    bits, scale = p
    sb, _ = blocks(unpack_bits(bits, 1, n).astype(_F32) * 2 - 1, block)
    return unblock(sb * scale[:, None], n)

  def error_bound(x):
    ab, scale = scales(x)
    return jnp.max(jnp.maximum(jnp.max(ab, axis=1) - scale, scale)) * (1 + F32_SLACK)

  return Codec(f"sign(block={block})", encode, decode,
               payload_bytes=lambda n: packed_bytes(n, 1) + 4 * num_blocks(n, block),
               error_bound=error_bound, collective="two_phase")


def log_quant(bits: int = 4, alpha: float = 10.0, *, block: int | None = None) -> Codec:
  """Logarithmic quantisation: a sign bit and bits-1 bits of log1p(alpha |x| / m) / log1p(alpha).

  m is the block's largest magnitude (float32, travels). Levels are dense near zero, where
  most gradient entries are; q(x) = sign(x) log(1 + alpha |x|) / log(1 + alpha) on the
  normalised |x| / m, inverse ((1 + alpha)^|q| - 1) / alpha, nearest rounding of |q| onto
  bits-1 bits.

  Args:
    bits: code width including the sign bit, 2..16.
    alpha: the curvature, > 0 (larger: finer resolution near zero).
    block: elements per scale block; None for one block.

  References:
    LQ-SGD, arXiv 2506.17974 (the quantiser of its low-rank factors).

  >>> c = log_quant(bits=8, alpha=10.0)
  >>> [round(float(v), 3) for v in c.roundtrip(jnp.array([1., -0.5, 0.]))], c.payload_bytes(3)
  ([1.0, -0.501, 0.0], 7)
  """
  bits = check_bits(bits, low=2)
  alpha = v.number("alpha", alpha, low=0.0, low_open=True)
  block = check_block(block)
  levels = 2 ** (bits - 1) - 1
  log1p_a = math.log1p(alpha)
  # Level j decodes to expm1(j / levels * log1p(alpha)) / alpha (times the block's m):
  # a table computed once in float64, so decode is a lookup, not an expm1 per element.
  magnitudes = (np.expm1(np.arange(levels + 1) / levels * log1p_a) / alpha).astype(np.float32)
  # Up to 15 levels, encode compares u = alpha |x| / m with the exact midpoints between
  # levels (expm1((j - 1/2) / levels * log1p(alpha)), rounded up to float32 so that u >= it
  # iff u >= the real midpoint): a few compares instead of a log1p per element.
  mids = None
  if levels <= 15:
    exact = np.expm1((np.arange(1, levels + 1) - 0.5) / levels * log1p_a)
    mids = exact.astype(np.float32)
    mids = np.where(mids < exact, np.nextafter(mids, np.float32(np.inf)), mids)

  def encode(x, key):
    del key
    xb, _ = blocks(x, block)
    m = jnp.max(jnp.abs(xb), axis=1)
    u = alpha * jnp.abs(xb) / _safe(m)[:, None]
    if mids is not None:
      lv = _rank(u, mids).astype(jnp.uint32)
    else:
      lv = jnp.clip(jnp.round(jnp.log1p(u) / log1p_a * levels), 0, levels).astype(jnp.uint32)
    code = lv | ((xb < 0).astype(jnp.uint32) << (bits - 1))
    return (pack_bits(unblock(code, x.shape[0]), bits), m)

  def decode(p, n):
    codes, m = p
    code = unpack_bits(codes, bits, n)
    mag = _lookup(code & levels, magnitudes)
    vb, _ = blocks(jnp.where((code >> (bits - 1)) == 1, -mag, mag), block)
    return unblock(vb * m[:, None], n)

  # The widest gap between levels is the top one (the inverse map is convex).
  top_gap = (math.expm1(log1p_a) - math.expm1((1 - 1 / levels) * log1p_a)) / alpha

  def error_bound(x):
    return jnp.max(_amax(x, block)) * (top_gap / 2 + F32_SLACK * levels)

  return Codec(f"log_quant({bits}, alpha={alpha:g}, block={block})", encode, decode,
               payload_bytes=lambda n: packed_bytes(n, bits) + 4 * num_blocks(n, block),
               error_bound=error_bound, collective="two_phase")


_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def fp4(*, block: int | None = 32, stochastic: bool = False) -> Codec:
  """4-bit floats (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives) with a scale per block.

  Each block is scaled so its largest magnitude maps to 6; codes (sign bit and a 3-bit
  magnitude index) travel packed two per byte, scales as float32 (MX formats use 8-bit
  power-of-two scales; float32 keeps the reconstruction simple and costs 4 bytes per block).

  Args:
    block: elements per scale; None for one scale.
    stochastic: stochastic rounding between neighbouring E2M1 values (unbiased, needs a key).

  References:
    Streaming DiLoCo, arXiv 2501.18512 (outer gradients in E2M1); OCP Microscaling formats.

  >>> c = fp4(block=None)
  >>> c.roundtrip(jnp.array([6., -3., 0.7, 1.3])), c.payload_bytes(4)
  (Array([ 6. , -3. ,  0.5,  1.5], dtype=float32), 6)
  """
  block = check_block(block)
  mids = (_E2M1[1:] + _E2M1[:-1]) / 2

  def scaled(x):
    xb, _ = blocks(x, block)
    scale = jnp.max(jnp.abs(xb), axis=1) / 6.0
    v = jnp.abs(xb) / _safe(scale)[:, None]
    lo = jnp.minimum(_rank(v, _E2M1[1:]), 6)  # _E2M1[lo] <= v
    return xb, scale, v, lo

  def encode(x, key):
    if stochastic:
      _need_key(key, "fp4(stochastic=True)")
    xb, scale, v, lo = scaled(x)
    if stochastic:
      below, above = _lookup(lo, _E2M1), _lookup(lo + 1, _E2M1)
      idx = lo + (_random.uniform(key, v.shape) < (v - below) / (above - below))
    else:
      idx = _rank(v, mids, strict=True)  # the nearest grid value; ties go down
    code = idx.astype(jnp.uint32) | ((xb < 0).astype(jnp.uint32) << 3)
    return (pack_bits(unblock(code, x.shape[0]), 4), scale)

  def decode(p, n):
    codes, scale = p
    code = unpack_bits(codes, 4, n)
    mag = _lookup(code & 7, _E2M1)
    vb, _ = blocks(jnp.where((code >> 3) == 1, -mag, mag), block)
    return unblock(vb * scale[:, None], n)

  def error_bound(x):  # Widest E2M1 gap is 4..6: 2 scale units.
    return jnp.max(_amax(x, block)) / 6.0 * ((2.0 if stochastic else 1.0) + F32_SLACK * 8)

  def variance_bound(x):  # Stochastic rounding across a gap g: variance <= g^2 / 4.
    _, scale, _, lo = scaled(x)
    gap = (_lookup(lo + 1, _E2M1) - _lookup(lo, _E2M1)) * scale[:, None]
    return jnp.sum(gap ** 2) / 4

  return Codec(f"fp4(block={block}{', stochastic' if stochastic else ''})", encode, decode,
               payload_bytes=lambda n: packed_bytes(n, 4) + 4 * num_blocks(n, block),
               stochastic=stochastic, unbiased=stochastic, error_bound=error_bound,
               variance_bound=variance_bound if stochastic else None, collective="two_phase")


_FP8 = {"e4m3fn": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def fp8(fmt: str = "e4m3fn", *, block: int | None = None) -> Codec:
  """8-bit floats with a float32 scale per block (the block's largest magnitude maps to the
  format's largest value, so nothing overflows).

  Unscaled fp8 is `cast("float8_e4m3fn")`, which is linear but overflows past 448. The
  payload is the fp8 values (they travel as their bits) and the scales.

  Args:
    fmt: "e4m3fn" or "e5m2".
    block: elements per scale; None for one scale.

  References:
    torchft's fp8 all-reduce; Micikevicius et al., FP8 Formats for Deep Learning,
    arXiv 2209.05433.

  >>> c = fp8(block=None)
  >>> c.roundtrip(jnp.array([448., -1.])), c.payload_bytes(2)
  (Array([448.,  -1.], dtype=float32), 6)
  """
  fmt = v.one_of("fmt", fmt, sorted(_FP8))
  block = check_block(block)
  dt = jnp.dtype(_FP8[fmt])
  fmax, eps = float(jnp.finfo(dt).max), float(jnp.finfo(dt).eps)

  def encode(x, key):
    del key
    xb, _ = blocks(x, block)
    scale = jnp.max(jnp.abs(xb), axis=1) / fmax
    return (unblock((xb / _safe(scale)[:, None]).astype(dt), x.shape[0]), scale)

  def decode(p, n):
    vals, scale = p
    vb, _ = blocks(vals.astype(_F32), block)
    return unblock(vb * scale[:, None], n)

  def error_bound(x):
    return jnp.max(_amax(x, block)) * (eps / 2 + F32_SLACK)

  return Codec(f"fp8({fmt}, block={block})", encode, decode,
               payload_bytes=lambda n: n + 4 * num_blocks(n, block),
               error_bound=error_bound, collective="two_phase")
