"""Shape-aware codecs: a factory from the parameter shapes wherever a transform takes a codec,
and codecs that need the whole vector refused by collectives that would split it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, comm, local, parallel, sync, testing

W = 8
# testing.example_params: b f32[4], w f32[3, 4] (flat order b, w). With chunk 4, k 2:
# b is one 1 x 4 tile, w one 3 x 4 tile; 2 (f32 value, u8 index) pairs each = 4 * 5 bytes.
TILES = functools.partial(codecs.tiled_dct_top_k, chunk=4, k=2)
PAYLOAD = 4 * (4 + 1)


def _by_hand():
  return codecs.tiled_dct_top_k([(4,), (3, 4)], chunk=4, k=2)


def _same_runs(mesh, make):
  """check_on_mesh of make(factory) and make(codec built by hand): equal states and bytes."""
  runs = [testing.check_on_mesh(make(c), mesh, steps=1) for c in (TILES, _by_hand())]
  (_, s1, m1, r1), (_, s2, m2, r2) = runs
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(m1["wire_bytes"]) == int(m2["wire_bytes"]) == round(r1.wire_bytes())
  return int(m1["wire_bytes"])


def test_for_tree_calls_the_factory_with_the_shapes_in_flat_order():
  seen = []
  made = codecs.for_tree(lambda shapes: seen.append(shapes) or codecs.top_k(0.5),
                         testing.example_params())
  assert seen == [[(4,), (3, 4)]] and made.length == 16  # made for these shapes: whole vector
  assert not codecs.splittable(made) and codecs.splittable(codecs.top_k(0.5))
  assert codecs.for_tree(TILES, testing.example_params()).payload_bytes(16) == PAYLOAD


def test_compressed_with_a_factory_equals_the_codec_built_by_hand(mesh8):
  nbytes = _same_runs(mesh8, lambda c: optax.chain(
      sync.compressed(c, memory="ef", axis_name="data"), optax.sgd(0.1)))
  assert nbytes == (W - 1) * PAYLOAD  # collective=None picks gather: (W - 1) payloads


def test_other_transforms_take_a_factory(mesh8):
  # Gradient coding (it encodes only on a mesh): the same run as the hand-built codec.
  code = sync.fractional_repetition(W, 1)
  _same_runs(mesh8, lambda c: optax.chain(sync.gradient_coding(code, codec=c), optax.sgd(0.1)))
  # DiLoCo (outer gradient every step) and CHOCO on one device: the same updates.
  params = testing.example_params()
  for make in (lambda c: local.diloco(optax.sgd(0.1), optax.sgd(1.0), 1, None, codec=c,
                                      memory="ef"),
               lambda c: sync.choco(optax.sgd(0.1), "ring", c, num_workers=W, axis_name=None)):
    outs = []
    for c in (TILES, _by_hand()):
      one_update = lambda p, tx=make(c): codecs.flatten(tx.update(p, tx.init(p), p)[0])[0]
      outs.append(jax.jit(one_update)(params))
    np.testing.assert_array_equal(*outs)
    assert float(jnp.max(jnp.abs(outs[0]))) > 0
  # Streaming DiLoCo's fragments are flat vectors: the factory sees [(m,)].
  seen = []
  tx = local.streaming_diloco(optax.sgd(0.1), optax.sgd(1.0), 2, 2, axis_name=None,
                              codec=lambda shapes: seen.append(shapes) or codecs.top_k(0.5))
  tx.update(params, tx.init(params), params)
  assert seen[0] == [(8,)]  # 16 elements in 2 fragments of 8


def test_whole_vector_codecs_refuse_collectives_that_split_at_build_time():
  for codec in (TILES, _by_hand()):
    with pytest.raises(ValueError, match="two_phase.*needs the whole vector"):
      sync.compressed(codec, collective="two_phase")
    with pytest.raises(ValueError, match="hierarchical.*needs the whole vector"):
      sync.compressed(codec, axis_name=("tensor", "data"))
    with pytest.raises(ValueError, match="needs the whole vector.*ZeRO"):
      parallel.zero(optax.sgd(0.1), 1, codec=codec)
  with pytest.raises(ValueError, match="factory.*must return a jaxcomm.codecs.Codec"):
    sync.compressed(lambda shapes: "top_k", axis_name=None).init(testing.example_params())
  with pytest.raises(ValueError, match="built for vectors of 16 elements.*has 3"):
    sync.compressed(_by_hand(), axis_name=None).init({"w": jnp.zeros(3)})


def test_two_phase_refuses_a_codec_with_a_length_when_traced(mesh8):
  f = jax.shard_map(lambda x: comm.two_phase(x, _by_hand(), "data")[0].total, mesh=mesh8,
                    in_specs=P(), out_specs=P())
  with pytest.raises(ValueError, match="needs the whole vector.*gather"):
    jax.eval_shape(f, jnp.zeros(16))
