"""Contract checks for your own codecs and transforms, to call from your own pytest files.

Every built-in codec and transform passes these (jaxcomm's own tests call them), the way
optax and chex ship the checks their own stages pass. A failure is an `AssertionError`
whose message names what broke and gives the expected and the actual numbers.

Codecs (the contract is `help(jaxcomm.codecs)`):

* `check_codec(codec)`: payload bytes, wire dtypes, accuracy against the stated error bound
  (or against the identity codec when there is none), that the codec tells x apart from
  zero, and every flag against the codec's behaviour (`linear`, `stochastic`, `shared_key`,
  `unbiased`, `variance_bound`), on several lengths.
* `codec_zoo()`: one instance of every built-in codec per setting of `CODEC_EXAMPLES` (the
  example arguments of every factory of `jaxcomm.codecs`, held complete).

Transforms (optax `GradientTransformation`s, usually a chain ending in an optimiser):

* `check_transform(tx)`: one device (build `tx` with `axis_name=None`): `jit` without
  recompiling, f32 and bf16 parameters keep their dtype, state types unchanged by `update`,
  `init` traced on `jax.ShapeDtypeStruct`s, convergence on a quadratic inside `lax.scan`.
* `check_on_mesh(tx, mesh)`: the transform in a training `Program`: compiles once, state
  types kept, and the bytes it counts equal `comm.inspect`'s reading of the compiled step.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import codecs, comm, train

__all__ = (
    "CODEC_EXAMPLES",
    "check_codec",
    "check_converges_on_quadratic",
    "check_jit_state_and_dtypes",
    "check_on_mesh",
    "check_transform",
    "codec_zoo",
    "example_params",
)

# Payload leaf dtypes that travel as they are: floats up to 32 bits, integers up to 32 bits.
_WIRE_DTYPES = tuple(jnp.dtype(d) for d in (
    jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2,
    jnp.uint8, jnp.uint16, jnp.uint32, jnp.int8, jnp.int16, jnp.int32))


#: Example arguments of every codec factory of `jaxcomm.codecs` (`codecs.names()`): one line
#: per factory, a list of keyword-argument settings, blocks and chunks small enough to matter
#: on ~1000 values. `codec_zoo` builds them, and a factory without a line fails every test
#: that uses the zoo, so a new codec cannot escape the codec suites. Add a codec: one line here.
CODEC_EXAMPLES = {
    "identity": [{}],
    "cast": [dict(dtype="float32"), dict(dtype="bfloat16"), dict(dtype="float8_e4m3fn")],
    "uniform": [dict(bits=4, block=64, symmetric=False), dict(bits=3, stochastic=True, block=100)],
    "qsgd": [dict(levels=7, bucket=128)],
    "sign": [dict(block=128)],
    "top_k": [dict(fraction=0.05), dict(k=4, chunk=64)],
    "random_k": [dict(fraction=0.1), dict(fraction=0.1, shared_key=False)],
    "rtop_k": [dict(r=0.2, k=0.05)],
    "dct_top_k": [dict(chunk=64, k=8)],
    "log_quant": [dict(bits=5, alpha=10.0, block=256)],
    "fp4": [{}, dict(stochastic=True)],
    "fp8": [dict(block=128), dict(fmt="e5m2")],
    # Built for given shapes (one length): in the zoo with whole=True only.
    "tiled_dct_top_k": [dict(shapes=[(24, 20), (20,), (2, 3, 5), ()], chunk=10, k=3)],
}


def codec_zoo(whole: bool = False) -> dict:
  """One instance of every built-in codec per setting of `CODEC_EXAMPLES`, by name.

  Built from `jaxcomm.codecs.names()`, so a codec factory without examples is an error here.

  Args:
    whole: include the codecs that need the whole vector (built for one length, as
      `tiled_dct_top_k` is for given shapes); by default only those that take any length.

  Returns:
    A dict from each codec's name to the codec.

  >>> "top_k(k=4, chunk=64)" in codec_zoo()
  True
  """
  missing = sorted(set(codecs.names()) - set(CODEC_EXAMPLES))
  if missing:
    raise AssertionError(f"codec factories without examples: {missing}; add a line to "
                         "jaxcomm.testing.CODEC_EXAMPLES.")
  zoo = [codecs.load(name)(**kwargs) for name in codecs.names()
         for kwargs in CODEC_EXAMPLES[name]]
  return {c.name: c for c in zoo if whole or c.length is None}


# ---------------------------------------------------------------------------- codecs
def _gradient_like(seed: int, n: int) -> np.ndarray:
  """Heavy-tailed like a gradient (a few large entries among many small), max |x| = 100.

  100 keeps unscaled fp8 (largest e4m3 value 448) in range, also for sums of three. Made
  with numpy: an eager JAX op would compile once per length.
  """
  rng = np.random.default_rng(seed)
  x = rng.normal(size=n) * np.exp(2.0 * rng.normal(size=n))
  return (x * (100.0 / np.max(np.abs(x)))).astype(np.float32)


def _show(tree) -> str:
  return "(" + ", ".join(f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
                         for x in jax.tree.leaves(tree)) + ")"


def _fail(codec: codecs.Codec, what: str):
  raise AssertionError(f"check_codec({codec.name}): {what}")


def _check_payload_types(codec: codecs.Codec, n: int) -> tuple:
  """The traced payload for length n: a tuple of wire-dtype arrays of payload_bytes(n)."""
  try:
    spec = codecs.payload_spec(codec, n)
  except ValueError as e:
    _fail(codec, str(e))
  if not isinstance(spec, tuple):
    _fail(codec, f"encode must return a tuple of arrays (the payload), got {spec!r}.")
  for i, leaf in enumerate(spec):
    if not hasattr(leaf, "dtype"):
      _fail(codec, f"payload leaf {i} is {leaf!r}, not an array.")
    dt = jnp.dtype(leaf.dtype)
    if dt == jnp.bool_:
      _fail(codec, f"payload leaf {i} is bool{list(leaf.shape)} for n = {n}: a bool takes a "
                   f"byte on the wire; pack bits into uint8 with codecs.pack_bits.")
    if dt not in _WIRE_DTYPES:
      _fail(codec, f"payload leaf {i} is {dt.name}{list(leaf.shape)} for n = {n}; wire dtypes "
                   f"are floats and integers of at most 32 bits "
                   f"({', '.join(d.name for d in _WIRE_DTYPES)}).")
  counted, actual = codec.payload_bytes(n), comm.tree_bytes(spec)
  if not isinstance(counted, (int, np.integer)):
    _fail(codec, f"payload_bytes({n}) must be a Python int, got {counted!r}.")
  if counted != actual:
    _fail(codec, f"payload_bytes({n}) = {counted}, but encode(f32[{n}]) returns {actual} bytes: "
                 f"{_show(spec)}.")
  return spec


def _check_decode_signature(codec: codecs.Codec, spec: tuple, n: int) -> None:
  key = jax.random.key(0)
  try:
    out = jax.eval_shape(lambda p: codec.decode_with(p, n, key), spec)
  except TypeError as e:
    flag = "shared_key=True" if not codec.shared_key else "shared_key=False"
    _fail(codec, f"decode raised TypeError: {e}. decode is called as decode(payload, n) "
                 f"unless the codec says shared_key=True, then as decode(payload, n, key); "
                 f"check the flag ({flag}?).")
  if out.shape != (n,) or out.dtype != jnp.float32:
    _fail(codec, f"decode(payload, {n}) must return float32[{n}], got "
                 f"{jnp.dtype(out.dtype).name}{list(out.shape)}.")


def _sum_payloads(payloads: Sequence[tuple]) -> tuple:
  """Leafwise sum, as a reduction in the wire type does: floats accumulate in float32."""
  def add(*leaves):
    if jnp.issubdtype(leaves[0].dtype, jnp.floating):
      return sum(x.astype(jnp.float32) for x in leaves).astype(leaves[0].dtype)
    return sum(leaves[1:], leaves[0])
  return tuple(jax.tree.map(add, *payloads))


def _trial(codec: codecs.Codec, xs: list, other, key, bound_fn, draws: int,
           splittable: bool) -> dict:
  """Everything check_codec compares, computed in one compiled program."""
  keyed = codec.stochastic or codec.shared_key
  keys = [jax.random.fold_in(key, i) if keyed else None for i in range(len(xs))]
  out = {"rt": [codec.roundtrip(x, k) for x, k in zip(xs, keys)],
         "bound": [bound_fn(x) if bound_fn else jnp.zeros(()) for x in xs]}
  x, k, n = xs[-1], keys[-1], xs[-1].shape[0]  # the caller's x, else the last length
  if codec.linear:  # three workers' payloads: same key if shared, else one key each
    ks = [k if codec.shared_key or k is None else jax.random.fold_in(k, j) for j in range(3)]
    pays = [codec.encode(v, kj) for v, kj in zip([x, -0.7 * jnp.roll(x, 1), other], ks)]
    out["linear"] = (codec.decode_with(_sum_payloads(pays), n, ks[0]),
                     sum(codec.decode_with(p, n, kj) for p, kj in zip(pays, ks)))
  if codec.decode_sum is not None:  # three workers' payloads decoded and summed in one pass
    ks = [None if k is None else jax.random.fold_in(k, j) for j in range(3)]
    pays = [codec.encode(v, kj) for v, kj in zip([x, -0.7 * jnp.roll(x, 1), other], ks)]
    stacked = jax.tree.map(lambda *p: jnp.stack(p), *pays)
    out["decode_sum"] = (codec.decode_sum(stacked, n),
                         sum(codec.decode_with(p, n, kj) for p, kj in zip(pays, ks)))
  if splittable and x.shape[0] > 1:  # two-phase collectives vmap encode over chunks
    two = jnp.stack([x, -x[::-1]])
    ks = jax.random.split(key, 2) if keyed else None
    pays = jax.vmap(codec.encode, in_axes=(0, 0 if keyed else None))(two, ks)
    pick = lambda j: jax.tree.map(lambda p: p[j], pays)
    out["vmap"] = [(two[j], codec.decode_with(pick(j), x.shape[0], None if ks is None else ks[j]),
                    bound_fn(two[j]) if bound_fn else jnp.zeros(())) for j in range(2)]
  if codec.unbiased:  # lax.map, not vmap: one compiled body (a vmap compiles much longer)
    ks = jax.random.split(jax.random.fold_in(key, 7), draws)
    out["draws"] = lax.map(lambda k: codec.roundtrip(x, k), ks)
    out["variance"] = codec.variance_bound(x) if codec.variance_bound else None
  return out


def check_codec(codec: codecs.Codec, x: jax.Array | None = None, key: Any = None, *,
                lengths: Sequence[int] = (1, 37, 1000),
                error_bound: float | Callable[[jax.Array], Any] | None = None,
                draws: int = 64) -> None:
  """Holds a codec to the codec contract (`help(jaxcomm.codecs)`); AssertionError if not.

  On gradient-like vectors of each length in `lengths` (odd lengths and lengths that are
  not a multiple of a block or chunk; only the codec's `length` when it has one) and on `x`:

  * the payload is a tuple of arrays in wire dtypes (floats and integers of at most 32
    bits, no bool) whose bytes are exactly `payload_bytes(n)`;
  * decode returns float32[n], finite, within the error bound of x: `error_bound` if
    given, else the codec's own; a codec with neither is held to the identity codec
    (exact up to float32 rounding);
  * the round trip is closer to x than zeros are (a codec that decodes to zeros fails),
    except for unbiased codecs, whose single draws may be far off;
  * the flags: a codec that is not `stochastic` is encoded with key=None (one that draws
    random numbers anyway fails, naming the flag); `shared_key` matches decode's
    signature; `linear`: the decoded sum of three payloads equals the sum of their decodes;
    `decode_sum` (when given) of three stacked payloads equals the sum of their decodes;
    `unbiased`: the mean of `draws` round trips is as close to x as an unbiased estimate's
    would be; `variance_bound` bounds their mean squared error; `collective` is "gather"
    or "two_phase"; encode vmaps over chunks as the two-phase collectives need.

  Args:
    codec: the `jaxcomm.codecs.Codec` to check.
    x: an extra f32[n] test vector (yours), checked with the generated ones.
    key: PRNG key for the test vectors and stochastic codecs (default `jax.random.key(0)`).
    lengths: vector lengths to test.
    error_bound: max |decode(encode(x)) - x| allowed: a number or `fn(x)`; default the
      codec's `error_bound`.
    draws: round trips averaged for the `unbiased` check.

  >>> from jaxcomm import codecs
  >>> check_codec(codecs.top_k(0.1))            # passes: returns None
  >>> zeros = codecs.Codec("zeros", encode=lambda x, key: (),
  ...                      decode=lambda p, n: jnp.zeros(n), payload_bytes=lambda n: 0)
  >>> check_codec(zeros)
  Traceback (most recent call last):
  ...
  AssertionError: check_codec(zeros): it states no error bound, so it is held to the identity ...
  """
  if not isinstance(codec, codecs.Codec):
    raise AssertionError(f"check_codec: expected a jaxcomm.codecs.Codec, got {codec!r}.")
  if codec.collective not in ("gather", "two_phase"):
    _fail(codec, f"collective must be 'gather' or 'two_phase', got {codec.collective!r}.")
  if codec.unbiased and draws < 8:
    raise ValueError(f"draws must be >= 8 to test unbiasedness, got {draws}.")
  key = jax.random.key(0) if key is None else key
  lengths = [codec.length] if codec.length is not None else list(lengths)
  xs = [_gradient_like(n, n) for n in lengths]
  if x is not None:
    xs.append(np.asarray(x, np.float32).reshape(-1))
  other = _gradient_like(10**6, xs[-1].shape[0])  # a third worker's vector, for linearity
  for v in xs:
    spec = _check_payload_types(codec, v.shape[0])
    _check_decode_signature(codec, spec, v.shape[0])
  if callable(error_bound):
    bound_fn = error_bound
  elif error_bound is not None:
    bound_fn = lambda _: jnp.asarray(error_bound, jnp.float32)
  else:
    bound_fn = codec.error_bound
  out = jax.jit(lambda xs, other, key: _trial(codec, xs, other, key, bound_fn, draws,
                                              codecs.splittable(codec)))(xs, other, key)
  xs = [np.asarray(v, np.float64) for v in xs]
  for v, rt, bound in zip(xs, out["rt"], out["bound"]):
    _check_round_trip(codec, v, np.asarray(rt), float(bound), bound_fn is not None)
  if codec.linear:
    _check_linear(codec, xs[-1].shape[0], *(np.asarray(a, np.float64) for a in out["linear"]))
  if codec.decode_sum is not None:
    _check_decode_sum(codec, xs[-1].shape[0],
                      *(np.asarray(a, np.float64) for a in out["decode_sum"]))
  for chunk, rt, bound in out.get("vmap", ()):  # encode under vmap, as two-phase sums run it
    _check_round_trip(codec, np.asarray(chunk, np.float64), np.asarray(rt), float(bound),
                      bound_fn is not None, " (encoded under jax.vmap, as two-phase sums do)")
  if codec.unbiased:
    _check_unbiased(codec, xs[-1], np.asarray(out["draws"], np.float64), out["variance"])


def _check_round_trip(codec, x, rt, bound, stated, how=""):
  n = f"{x.shape[0]}{how}"
  if rt.shape != x.shape or rt.dtype != np.float32:
    _fail(codec, f"decode(encode(x)) for n = {n} is {rt.dtype}{list(rt.shape)}, expected "
                 f"float32[{x.shape[0]}].")
  if not np.isfinite(rt).all():
    i = int(np.flatnonzero(~np.isfinite(rt))[0])
    _fail(codec, f"decode(encode(x)) for n = {n} is not finite at element {i} (x = {x[i]:.4g}, "
                 f"decoded {rt[i]}).")
  err = np.abs(rt - x)
  i = int(np.argmax(err))
  amax = float(np.max(np.abs(x)))
  if not stated:
    allowed = codecs.F32_SLACK * amax
    if err[i] > allowed:
      _fail(codec, f"it states no error bound, so it is held to the identity codec (exact "
                   f"round trip), but for n = {n} max |decode(encode(x)) - x| = {err[i]:.4g} at "
                   f"element {i} (x = {x[i]:.4g}, decoded {rt[i]:.4g}); the allowed error is "
                   f"{allowed:.4g}. Give the Codec an error_bound, or pass error_bound= here.")
  elif err[i] > bound:
    _fail(codec, f"for n = {n} max |decode(encode(x)) - x| = {err[i]:.4g} at element {i} "
                 f"(x = {x[i]:.4g}, decoded {rt[i]:.4g}) exceeds the error bound {bound:.4g}.")
  if not codec.unbiased and amax > 0:
    miss, norm = float(np.linalg.norm(rt - x)), float(np.linalg.norm(x))
    if miss >= norm:
      _fail(codec, f"for n = {n} ||decode(encode(x)) - x|| = {miss:.4g} >= ||x|| = {norm:.4g}: "
                   f"the round trip is no closer to x than zeros are (does decode return what "
                   f"encode kept?). Error feedback diverges with such a codec.")


def _check_linear(codec, n, decoded_sum, sum_decoded):
  """linear=True: decode(sum of payloads) = sum of decodes, up to the wire type's rounding."""
  err = np.abs(decoded_sum - sum_decoded)
  i = int(np.argmax(err))
  # Summing in a narrow wire float rounds the sum once more: a relative error of eps.
  eps = max([float(jnp.finfo(x.dtype).eps) for x in codecs.payload_spec(codec, n)
             if jnp.issubdtype(x.dtype, jnp.floating)] or [0.0])
  allowed = (eps + codecs.F32_SLACK) * float(np.max(np.abs(sum_decoded)) + 1.0)
  if err[i] > allowed:
    _fail(codec, f"linear=True, but the payloads do not sum: for n = {n}, decode(p1 + p2 + p3) "
                 f"= {decoded_sum[i]:.6g} at element {i} while decode(p1) + decode(p2) + "
                 f"decode(p3) = {sum_decoded[i]:.6g} (difference {err[i]:.4g}, allowed "
                 f"{allowed:.4g}). Collectives psum a linear codec's payloads, so the sums "
                 f"would be wrong; set linear=False (payloads then travel by gather).")


def _check_decode_sum(codec, n, one_pass, one_by_one):
  """decode_sum of stacked payloads = the sum of their decodes, up to float32 rounding."""
  err = np.abs(one_pass - one_by_one)
  i = int(np.argmax(err))
  allowed = codecs.F32_SLACK * float(np.max(np.abs(one_by_one)) + 1.0)
  if err[i] > allowed:
    _fail(codec, f"decode_sum of three stacked payloads (n = {n}) is {one_pass[i]:.6g} at "
                 f"element {i}, the sum of their decodes {one_by_one[i]:.6g} (difference "
                 f"{err[i]:.4g}, allowed {allowed:.4g}). The gather collective sums payloads "
                 f"with decode_sum, so the sums would be wrong.")


def _check_unbiased(codec, x, draws, variance):
  """unbiased=True: the mean of K draws is off by about sqrt(mse / K), not by the bias."""
  k, n = draws.shape[0], x.shape[0]
  mse = float(np.mean(np.sum((draws - x) ** 2, axis=1)))
  bias2 = float(np.sum((np.mean(draws, axis=0) - x) ** 2))
  slack = n * (codecs.F32_SLACK * float(np.max(np.abs(x)))) ** 2
  if bias2 > 4.0 * mse / k + slack:
    _fail(codec, f"unbiased=True, but the mean of {k} round trips of x (n = {n}) is off by "
                 f"||mean - x||^2 = {bias2:.4g}, while an unbiased codec's would be about "
                 f"mse / {k} = {mse / k:.4g} (4x allowed). Set unbiased=False, or draw the "
                 f"rounding from the key.")
  if variance is not None:
    v = float(variance)
    # The mean of K squared errors: allow its sampling error (a few sqrt(K)-th parts).
    if mse > v * (1.0 + 4.0 / math.sqrt(k)) + slack:
      _fail(codec, f"variance_bound(x) = {v:.4g}, but the mean squared error of {k} round "
                   f"trips of x (n = {n}) is {mse:.4g}.")


# ---------------------------------------------------------------------------- transforms
def example_params(dtype: Any = jnp.float32) -> dict:
  """The small parameter tree (two leaves, 16 elements) every transform check uses.

  >>> [x.shape for x in jax.tree.leaves(example_params())]  # flat order: b, w
  [(4,), (3, 4)]
  """
  return {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4).astype(dtype),
          "b": jnp.linspace(0.5, -0.5, 4, dtype=jnp.float32).astype(dtype)}


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _same_types(a, b, what):
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert (jnp.shape(x), jnp.result_type(x)) == (jnp.shape(y), jnp.result_type(y)), \
        f"{what}: {jnp.shape(x)} {jnp.result_type(x)} became {jnp.shape(y)} {jnp.result_type(y)}"


def check_jit_state_and_dtypes(tx: optax.GradientTransformation) -> None:
  """jit without recompiling, dtypes kept (f32 and bf16), state unchanged, init abstract.

  The second call must hit the compilation cache; dtypes and state types are static, so the
  bf16 checks read them from `jax.eval_shape` instead of compiling a second program.

  >>> check_jit_state_and_dtypes(optax.adam(1e-3))
  """
  params = example_params(jnp.float32)
  grads = jax.tree.map(lambda p: 0.3 * p + 0.1, params)
  state = tx.init(params)
  update = jax.jit(tx.update)
  updates, new_state = update(grads, state, params)
  compiled = update._cache_size()  # jit caches per function
  updates, new_state = update(grads, new_state, params)
  recompiled = update._cache_size() != compiled
  assert not recompiled, ("update recompiled on the second call: the state's types changed "
                          "(compare the state's leaves before and after update)")
  _same_types(state, new_state, "state after update")
  chex.assert_tree_all_finite(updates)
  for dtype in (jnp.float32, jnp.bfloat16):
    abstract = _abstract(example_params(dtype))
    state_abs = jax.eval_shape(tx.init, abstract)
    _same_types(state_abs, tx.init(example_params(dtype)), "init on ShapeDtypeStruct")
    updates_abs, new_state_abs = jax.eval_shape(tx.update, abstract, state_abs, abstract)
    _same_types(abstract, updates_abs, f"updates of {jnp.dtype(dtype).name} parameters")
    _same_types(state_abs, new_state_abs, "state after update")


def check_converges_on_quadratic(tx: optax.GradientTransformation, steps: int = 200,
                                 factor: float = 1e-2) -> float:
  """Minimises 0.5 ||p - target||^2 inside lax.scan; final loss < factor * initial.

  Returns:
    The final loss.

  >>> check_converges_on_quadratic(optax.sgd(0.1)) < 1e-6
  True
  """
  params = example_params(jnp.float32)
  target = jax.tree.map(lambda p: 1.0 + 0.5 * jnp.sin(3.0 * p), params)
  loss = lambda p: 0.5 * sum(jnp.sum((a - b) ** 2) for a, b in
                             zip(jax.tree.leaves(p), jax.tree.leaves(target)))

  @jax.jit
  def run(params):
    def body(carry, _):
      p, s = carry
      u, s = tx.update(jax.grad(loss)(p), s, p)
      return (optax.apply_updates(p, u), s), None
    (p, _), _ = lax.scan(body, (params, tx.init(params)), None, length=steps)
    return loss(p)

  final, initial = float(run(params)), float(loss(params))
  assert final < factor * initial, (f"did not converge: loss {initial:.4g} -> {final:.4g} after "
                                    f"{steps} steps, expected below {factor * initial:.4g}")
  return final


def check_transform(tx: optax.GradientTransformation, steps: int = 200,
                    factor: float = 1e-2) -> None:
  """Every one-device check of a transform (build `tx` with `axis_name=None`).

  >>> from jaxcomm import codecs, sync
  >>> check_transform(optax.chain(sync.compressed(codecs.top_k(0.5), memory="ef",
  ...                                             axis_name=None), optax.sgd(0.1)))
  """
  check_jit_state_and_dtypes(tx)
  check_converges_on_quadratic(tx, steps, factor)


def check_on_mesh(tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                  batch_axes: comm.AxisName = "data", steps: int = 2):
  """The transform in a `train.Program`: compiles once, state types kept, bytes == inspect.

  Each worker minimises 0.5 ||p - t_w||^2 with its own target t_w. `comm.inspect` turns
  operand bytes into wire bytes with the same per-op helpers as the counters, so bytes ==
  inspect proves the operand shapes and trip counts; hold the bytes against a literal or a
  formula of your own as well (docs/algorithms.md), as jaxcomm's tests do.

  Args:
    tx: the transform (synchronising over `batch_axes`).
    mesh: the device mesh.
    batch_axes: the mesh axes the batch is split over (the program's workers).
    steps: how many steps to run.

  Returns:
    `(program, state, measurements, report)`: the last step's state and measurements and
    the `comm.inspect` report of the compiled step, for further checks.

  >>> from jaxcomm import sync, train
  >>> mesh = train.make_mesh({"data": 8})
  >>> _, _, m, report = check_on_mesh(optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh)
  >>> int(m["wire_bytes"])  # 16 float32 all-reduced over 8 devices: 2 * 7/8 * 64
  112
  """
  axes = batch_axes if isinstance(batch_axes, tuple) else (batch_axes,)
  w = math.prod(mesh.shape[a] for a in axes)
  params = example_params(jnp.float32)
  loss = lambda p, b: 0.5 * sum(jnp.sum((x - b["t"][0, i]) ** 2)
                                for i, x in enumerate(jax.tree.leaves(p)))
  batch = {"t": jnp.arange(w * 2, dtype=jnp.float32).reshape(w, 2) / w}
  program = train.make_program(loss, tx, mesh, params, batch_axes=batch_axes)
  state = program.init(params)
  first = state
  fn = program.step
  state, per_device, sent = program.dispatch(state, batch)
  compiled = fn._cache_size()
  for _ in range(steps - 1):
    state, per_device, sent = program.dispatch(state, batch)
  m = program.measure(per_device, sent)
  assert fn._cache_size() == compiled, "the step recompiled"
  _same_types(first, state, "train state after steps")
  report = comm.inspect(fn, first, batch)
  counted, read = int(m["wire_bytes"]), round(report.wire_bytes())
  assert counted == read, (f"the transform counted {counted} wire bytes in its last step, but "
                           f"the compiled step's collectives move {read}:\n{report.table()}")
  return program, state, m, report
