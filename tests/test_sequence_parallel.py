"""Sequence parallel attention (ring, Ulysses, LASP-2, All-Scan, LASP ring) on 8 devices.

Every variant runs under shard_map on a data=2 x sequence=4 mesh and is held, in value and
gradient, against plain causal attention (softmax or linear) on one device, at two sequence
lengths; the wire bytes of the compiled program are held against the formulas.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import comm
from jaxcomm import models
from jaxcomm import parallel
from jaxcomm import sync
from jaxcomm import train

W = 4                      # sequence axis size
B, H, DH = 2, 4, 8         # global batch (1 per data worker), heads, head width
DECAY = np.array([0.9, 0.7, 1.0, 0.5], np.float32)
SEQ_LENS = (16, 32)


@pytest.fixture(scope="module")
def mesh():
  return train.make_mesh({"data": 2, "sequence": W})


# Wire bytes per device of one forward + backward, from docs/algorithms.md, written out here
# (not the library's *_bytes helpers, which test_byte_helpers_equal_hand_literals pins).
# blk: this device's [B, T/W, H, Dh] block; f32 everywhere.
def ring_bytes(blk):
  q = np.prod(blk)  # K and V shift W-1 times each way; the f32 dK, dV accumulators W times
  return {"forward": (W - 1) * 2 * q * 4, "backward": (W - 1) * 2 * q * 4 + W * 2 * q * 4}


def ulysses_bytes(blk):
  q = np.prod(blk) * 4  # all-to-all of stacked Q, K, V and one of the output, each way
  return {"forward": (W - 1) / W * (3 * q + q), "backward": (W - 1) / W * (3 * q + q)}


def lasp2_bytes(blk):
  s = blk[0] * blk[2] * blk[3] * blk[3] * 4  # one B x H x Dk x Dv f32 state per device
  return {"forward": (W - 1) * s, "backward": (W - 1) / W * (W * s)}


def allscan_bytes(blk, pieces=W):
  s = blk[0] * blk[2] * blk[3] * blk[3]  # W + K - 2 chain steps of ceil(s / K) elements
  return {"forward": (W + pieces - 2) * -(-s // pieces) * 4,
          "backward": (W + pieces - 2) * -(-s // pieces) * 4}


# name: (per-device kernel, one-device reference, zig-zag layout, bytes formula on a block)
VARIANTS = {
    "ring": (parallel.attention_ring, models.causal_attention, False, ring_bytes),
    "ring_zigzag": (functools.partial(parallel.attention_ring, zigzag=True),
                    models.causal_attention, True, ring_bytes),
    "ulysses": (parallel.attention_ulysses, models.causal_attention, False, ulysses_bytes),
    "linear_lasp2": (functools.partial(parallel.linear_attention_lasp2, decay=DECAY),
                     functools.partial(parallel.linear_attention, decay=DECAY), False,
                     lasp2_bytes),
    "linear_allscan": (functools.partial(parallel.linear_attention_allscan, decay=DECAY),
                       functools.partial(parallel.linear_attention, decay=DECAY), False,
                       allscan_bytes),
    "linear_lasp_ring": (parallel.linear_attention_lasp_ring, parallel.linear_attention, False,
                         functools.partial(allscan_bytes, pieces=1)),
}


def test_byte_helpers_equal_hand_literals():
  # A [1, 4, 2, 8] block = 64 f32 on W = 4: K and V 512 bytes, shifted 3 times forward;
  # backward 3 shifts again + 4 shifts of the f32 dK, dV (512 bytes): 1536 + 2048.
  assert parallel.attention_ring_bytes((1, 4, 2, 8), 4) == {"forward": 1536.0,
                                                            "backward": 3584.0}
  # W = 2: all-to-all of Q, K, V (768 bytes) and of the output (256): 1/2 * 1024 each way.
  assert parallel.attention_ulysses_bytes((1, 4, 2, 8), 2) == {"forward": 512.0,
                                                               "backward": 512.0}
  # A [1, 16, 2, 4] block: state 1 x 2 x 4 x 4 f32 = 128 bytes; W = 4: gather 3 * 128, its
  # reduce-scatter 3/4 * 512. All-Scan with K = 4 pieces of 8: (4 + 4 - 2) * 32 bytes.
  assert parallel.linear_attention_lasp2_bytes((1, 16, 2, 4), 4) == {"forward": 384.0,
                                                                     "backward": 384.0}
  assert parallel.linear_attention_allscan_bytes((1, 16, 2, 4), 4) == {"forward": 192.0,
                                                                       "backward": 192.0}
  # The LASP ring (K = 1): 3 steps of the whole 128-byte state.
  assert parallel.linear_attention_allscan_bytes((1, 16, 2, 4), 4, num_pieces=1) == \
      {"forward": 384.0, "backward": 384.0}


def _inputs(seq_len):
  q, k, v, g = np.asarray(0.5 * jax.random.normal(jax.random.key(seq_len), (4, B, seq_len, H,
                                                                            DH)))
  return q, k, v, g


_REFERENCE = {}  # (attention, seq_len) -> one device's value and gradients (one compile each)


def _one_device(reference, seq_len):
  """Value and gradients of sum(reference(q, k, v) * g) on one device, on the host."""
  key = (getattr(reference, "func", reference), "decay" in getattr(reference, "keywords", {}),
         seq_len)  # every decayed reference takes DECAY
  if key not in _REFERENCE:
    q, k, v, g = _inputs(seq_len)
    _REFERENCE[key] = jax.tree.map(np.asarray, jax.jit(jax.value_and_grad(
        lambda q, k, v: jnp.sum(reference(q, k, v) * g), argnums=(0, 1, 2)))(q, k, v))
  return _REFERENCE[key]


def _sharded_value_and_grad(kernel, mesh):
  """jit(shard_map(value_and_grad of sum(attention(q, k, v) * g))) over data x sequence."""

  def local(q, k, v, g):
    loss = lambda q, k, v: jnp.sum(kernel(q, k, v, axis_name="sequence") * g)
    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    return comm.sum(value, ("data", "sequence"))[0], grads

  spec = P("data", "sequence")
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4,
                               out_specs=(P(), (spec,) * 3)))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_attention_equals_one_device_reference_and_bytes_follow_formula(name, mesh):
  kernel, reference, zigzag, formula = VARIANTS[name]
  step = _sharded_value_and_grad(kernel, mesh)
  seq_bytes = {}
  for seq_len in SEQ_LENS:
    q, k, v, g = _inputs(seq_len)
    order = parallel.zigzag_order(seq_len, W) if zigzag else np.arange(seq_len)
    args = tuple(x[:, order] for x in (q, k, v, g))
    compiled = step.lower(*args).compile()
    value, grads = compiled(*args)
    ref_value, ref_grads = _one_device(reference, seq_len)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-5)
    undo = np.argsort(order)
    for got, want in zip(grads, ref_grads):
      np.testing.assert_allclose(np.asarray(got)[:, undo], want, rtol=1e-4, atol=1e-5)
    # Bytes: the compiled step's sequence-axis traffic is the forward + backward formula.
    report = comm.parse_hlo(compiled.as_text(), mesh=mesh)
    block = (B // 2, seq_len // W, H, DH)
    expected = formula(block)
    assert report.wire_bytes(axes=("sequence",)) == expected["forward"] + expected["backward"]
    seq_bytes[seq_len] = report.wire_bytes(axes=("sequence",))
  short, long = (seq_bytes[t] for t in SEQ_LENS)
  if name.startswith("linear"):
    assert long == short > 0                      # state traffic: independent of T
  else:
    assert long == 2 * short > 0                  # K/V (or Q/K/V/O) traffic: linear in T


def test_ring_forward_moves_kv_w_minus_1_times(mesh):
  q, k, v, _ = _inputs(16)
  fwd = jax.jit(jax.shard_map(functools.partial(parallel.attention_ring, axis_name="sequence"),
                              mesh=mesh, in_specs=P("data", "sequence"),
                              out_specs=P("data", "sequence")))
  report = comm.inspect(fwd, q, k, v, mesh=mesh)
  permutes = report.select(op="collective-permute")
  assert {c.trips for c in permutes} == {W - 1} and len(permutes) == 2   # K and V
  assert report.wire_bytes() == (W - 1) * 2 * (B // 2) * (16 // W) * H * DH * 4


def test_linear_attention_reference_is_the_decayed_recurrence():
  q, k, v, _ = _inputs(16)
  out = parallel.linear_attention(q, k, v, decay=DECAY)
  state = np.zeros((B, H, DH, DH), np.float32)
  rows = []
  for t in range(16):
    state = DECAY[None, :, None, None] * state + np.einsum("bhd,bhe->bhde", k[:, t], v[:, t])
    rows.append(np.einsum("bhd,bhde->bhe", q[:, t], state))
  np.testing.assert_allclose(out, np.stack(rows, axis=1), rtol=1e-4, atol=1e-5)


def test_all_gather_varying_transposes_to_reduce_scatter(mesh):
  def local(x):
    def loss(x):
      gathered, nbytes = comm.all_gather(x, "sequence", invariant=False)
      assert nbytes == (W - 1) * x.size * 4
      return jnp.sum(gathered * jnp.arange(W, dtype=x.dtype)[:, None, None])
    value, grad = jax.value_and_grad(loss)(x)
    return value[None], grad

  f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("sequence"),
                            out_specs=(P("sequence"), P("sequence"))))
  x = jnp.ones((W, 3))
  # Each of the W devices' losses holds r * x_r: the transpose sums W copies of r.
  np.testing.assert_allclose(f(x)[1], np.repeat(W * np.arange(W)[:, None], 3, axis=1))
  report = comm.inspect(f, x, mesh=mesh)
  assert sorted(c.op for c in report) == ["all-gather", "reduce-scatter"]
  assert report.wire_bytes() == 2 * (W - 1) * 3 * 4


# ---------------------------------------------------------------------------- the LM
LM = dict(d_model=16, num_layers=2, num_heads=4, d_ff=32, max_len=16)


@pytest.fixture(scope="module")
def lm_setup():
  """Parameters, tokens, and per reference attention (computed once) its loss and the
  parameters after one SGD step on one device (on the host)."""
  lm = models.TransformerLM(**LM)
  params = jax.jit(lm.init)(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, 17), 0, 256))
  refs = {}

  def reference(kind, lr):
    if (kind, lr) not in refs:
      ref_lm = models.TransformerLM(**LM, attention_fn=models.sequence_attention(kind, None))
      loss, grads = jax.jit(jax.value_and_grad(models.lm_loss(ref_lm)))(
          params, {"tokens": tokens})
      refs[kind, lr] = loss, jax.tree.map(lambda p, g: np.asarray(p) - lr * np.asarray(g),
                                          params, grads)
    return refs[kind, lr]
  return params, tokens, reference


@pytest.mark.parametrize("kind,reference", [("ring_zigzag", "softmax"),
                                            ("ulysses", "softmax"),
                                            ("linear_allscan", "linear")])
@pytest.mark.slow
def test_lm_trains_on_a_sequence_axis_like_one_device(kind, reference, mesh, lm_setup):
  params, tokens, one_device = lm_setup
  lr = 0.5
  ref_loss, want = one_device(reference, lr)
  lm = models.TransformerLM(**LM, attention_fn=models.sequence_attention(kind))
  trainer = train.Trainer(models.lm_loss_sequence(lm),
                          optax.chain(sync.mean(("data", "sequence")), optax.sgd(lr)), mesh,
                          batch_axes=("data", "sequence"), batch_specs=P("data", "sequence"))
  state = trainer.init(params)
  batch = trainer.shard_batch(models.lm_sequence_batch(tokens, W, zigzag=kind == "ring_zigzag"))
  state, m = trainer.step(state, batch)
  np.testing.assert_allclose(m["loss"], ref_loss, rtol=1e-5)
  for got, exp in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, exp, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- bad input
def test_bad_sequence_layouts_fail_before_compile(mesh):
  with pytest.raises(ValueError, match="seq_len"):
    models.check_sequence_layout(30, 4, W, "ring")
  with pytest.raises(ValueError, match="zig-zag"):
    models.check_sequence_layout(36, 4, W, "ring_zigzag")
  with pytest.raises(ValueError, match="num_heads"):
    models.check_sequence_layout(32, 6, W, "ulysses")
  with pytest.raises(ValueError, match="kind must be one of 'ring'"):
    models.check_sequence_layout(32, 4, W, "flash")
  with pytest.raises(ValueError, match="divisible"):
    models.lm_sequence_batch(np.zeros((2, 31), np.int32), W)
  with pytest.raises(ValueError, match="zig-zag"):
    parallel.zigzag_order(12, W)
  with pytest.raises(ValueError, match="decay"):
    parallel.linear_attention(*_inputs(16)[:3], decay=1.5)
  # Inside a trace the kernels check shapes while tracing: still before any compile.
  x = jnp.zeros((2, 16, 6, DH))
  f = jax.shard_map(functools.partial(parallel.attention_ulysses, axis_name="sequence"),
                    mesh=mesh, in_specs=P("data", "sequence"), out_specs=P("data", "sequence"))
  with pytest.raises(ValueError, match="num_heads"):
    jax.eval_shape(f, x, x, x)
