"""The transformer LM on a `sequence` axis (sharded tokens) and on a `pipeline` axis (stages).

Sequence layout: every device of the sequence axis holds a slice of each sequence (tokens,
next-token targets and their global positions); attention is one of the sequence-parallel
kernels of `jaxcomm.parallel`, everything else is per token. Each device's loss is the mean
over its tokens, so the mean over devices is the full loss.

Pipeline layout: the LM's blocks are stacked into S stages of L/S blocks ([S, L/S, ...]
leaves sharded over the pipeline axis); the embedding, positions, final norm and head are
shared (replicated) and used by the first and last stage.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxcomm import _validate as v
from jaxcomm import parallel
from jaxcomm.models._transformer import Block
from jaxcomm.models._transformer import TransformerLM
from jaxcomm.models._transformer import causal_attention
from jaxcomm.models._transformer import embed_forward
from jaxcomm.models._transformer import head_forward

#: The sequence-parallel attention kernels `sequence_attention` builds, by name.
SEQUENCE_ATTENTION = ("ring", "ring_zigzag", "ulysses", "linear_lasp2", "linear_allscan",
                      "linear_lasp_ring")


def sequence_attention(kind: str, axis_name: str | None = "sequence", *,
                       decay=None) -> Callable:
  """The attention kernel `(q, k, v) -> out` for `TransformerLM(attention_fn=...)`.

  Args:
    kind: one of `SEQUENCE_ATTENTION` (`linear_*` are causal linear attention), or
      "softmax" / "linear" for the one-device references.
    axis_name: the sequence mesh axis (None: one device).
    decay: decay of the linear kinds (None, a scalar or f32[H]).

  >>> sequence_attention("ring").func.__name__
  'attention_ring'
  """
  kinds = {
      "ring": functools.partial(parallel.attention_ring, axis_name=axis_name),
      "ring_zigzag": functools.partial(parallel.attention_ring, axis_name=axis_name,
                                       zigzag=True),
      "ulysses": functools.partial(parallel.attention_ulysses, axis_name=axis_name),
      "linear_lasp2": functools.partial(parallel.linear_attention_lasp2, axis_name=axis_name,
                                        decay=decay),
      "linear_allscan": functools.partial(parallel.linear_attention_allscan,
                                          axis_name=axis_name, decay=decay),
      "linear_lasp_ring": functools.partial(parallel.linear_attention_lasp_ring,
                                            axis_name=axis_name, decay=decay),
      "softmax": causal_attention,
      "linear": functools.partial(parallel.linear_attention, decay=decay),
  }
  return kinds[v.one_of("kind", kind, kinds)]


def check_sequence_layout(seq_len: int, num_heads: int, axis_size: int, kind: str) -> None:
  """Raises ValueError if `kind` cannot run `seq_len` tokens on `axis_size` devices.

  >>> check_sequence_layout(64, 4, 4, "ulysses")
  """
  sequence_attention(kind, None)  # validates the kind
  if seq_len % axis_size:
    raise ValueError(f"seq_len ({seq_len}) must be divisible by the sequence axis size "
                     f"({axis_size}).")
  if kind == "ring_zigzag" and seq_len % (2 * axis_size):
    raise ValueError(f"seq_len ({seq_len}) must be divisible by 2 * the sequence axis size "
                     f"({2 * axis_size}) for the zig-zag layout.")
  if kind == "ulysses" and num_heads % axis_size:
    raise ValueError(f"num_heads ({num_heads}) must be divisible by the sequence axis size "
                     f"({axis_size}) for Ulysses.")


def lm_sequence_batch(tokens, axis_size: int, *, zigzag: bool = False) -> dict:
  """Host-side: `{'tokens': i32[B, T+1]}`-style windows -> inputs, targets and positions.

  The result's [B, T] arrays are sharded over the sequence axis on dimension 1 (in the
  zig-zag order if `zigzag`).

  >>> b = lm_sequence_batch(np.arange(9)[None], 2, zigzag=True)
  >>> b["positions"].tolist(), b["targets"].tolist()
  ([[0, 1, 6, 7, 2, 3, 4, 5]], [[1, 2, 7, 8, 3, 4, 5, 6]])
  """
  tokens = np.asarray(tokens)
  t = tokens.shape[1] - 1
  if t % axis_size:
    raise ValueError(f"the sequence length ({t}) must be divisible by the sequence axis size "
                     f"({axis_size}).")
  order = parallel.zigzag_order(t, axis_size) if zigzag else np.arange(t)
  positions = np.broadcast_to(order, (tokens.shape[0], t)).astype(np.int32)
  return {"inputs": tokens[:, :-1][:, order], "targets": tokens[:, 1:][:, order],
          "positions": np.ascontiguousarray(positions)}


def lm_loss_sequence(model: TransformerLM) -> Callable:
  """`loss(params, batch)`: mean next-token cross-entropy over this device's tokens.

  `batch` holds this device's slice of `lm_sequence_batch`: `inputs`, `targets` and
  `positions`, each i32[B, T/W]. `model.attention_fn` is the sequence-parallel kernel.

  >>> lm = TransformerLM(d_model=8, num_layers=1, num_heads=2, d_ff=16, max_len=4)
  >>> params = lm.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  >>> batch = {"inputs": jnp.zeros((2, 4), jnp.int32), "targets": jnp.ones((2, 4), jnp.int32),
  ...          "positions": jnp.tile(jnp.arange(4), (2, 1))}
  >>> bool(lm_loss_sequence(lm)(params, batch) > 0)
  True
  """

  def loss_fn(params, batch):
    logits = model.apply(params, batch["inputs"], batch["positions"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return loss_fn


# ------------------------------------------------------------------------------ pipeline
def _num_blocks(params) -> int:
  return sum(1 for k in params["params"] if k.startswith("block"))


def lm_stage_params(params, num_stages: int) -> dict:
  """TransformerLM params -> `{'shared': ..., 'stages': leaves [S, L/S, ...]}`.

  >>> lm = TransformerLM(d_model=8, num_layers=2, num_heads=2, d_ff=16, max_len=4)
  >>> params = lm.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  >>> lm_stage_params(params, 2)["stages"]["qkv"]["kernel"].shape
  (2, 1, 8, 3, 2, 4)
  """
  layers = _num_blocks(params)
  if num_stages < 1 or layers % num_stages:
    raise ValueError(f"num_layers ({layers}) must be divisible by the number of pipeline "
                     f"stages ({num_stages}).")
  p = params["params"]
  blocks = [p[f"block{i}"] for i in range(layers)]
  per = layers // num_stages
  stages = jax.tree.map(lambda *xs: jnp.stack(xs).reshape(num_stages, per, *xs[0].shape),
                        *blocks)
  return {"shared": {k: x for k, x in p.items() if not k.startswith("block")},
          "stages": stages}


def lm_unstage_params(staged) -> dict:
  """Inverse of `lm_stage_params` (also turns staged gradients into LM-shaped ones).

  Example:
    >>> lm = TransformerLM(d_model=8, num_layers=2, num_heads=2, d_ff=16, max_len=4)
    >>> params = lm.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    >>> staged = lm_stage_params(params, 2)
    >>> jax.tree.structure(lm_unstage_params(staged)) == jax.tree.structure(params)
    True
  """
  leaf = jax.tree.leaves(staged["stages"])[0]
  layers = leaf.shape[0] * leaf.shape[1]
  flat = jax.tree.map(lambda x: x.reshape(layers, *x.shape[2:]), staged["stages"])
  blocks = {f"block{i}": jax.tree.map(lambda x, i=i: x[i], flat) for i in range(layers)}
  return {"params": {**staged["shared"], **blocks}}


def lm_stage_specs(staged, axis_name: str = "pipeline") -> dict:
  """PartitionSpecs: stage leaves split over `axis_name`, shared leaves replicated.

  Example:
    >>> lm = TransformerLM(d_model=8, num_layers=2, num_heads=2, d_ff=16, max_len=4)
    >>> params = lm.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    >>> staged = lm_stage_params(params, 2)
    >>> lm_stage_specs(staged)["stages"]["qkv"]["kernel"]
    P('pipeline',)
  """
  return {"shared": jax.tree.map(lambda _: P(), staged["shared"]),
          "stages": jax.tree.map(lambda _: P(axis_name), staged["stages"])}


def lm_loss_pipeline(model: TransformerLM, schedule: parallel.PipelineSchedule,
                     axis_name: str | None = "pipeline") -> Callable:
  """`loss(staged_params, {'tokens': i32[B, T+1]})` run by a pipeline schedule.

  Call inside `jax.shard_map` with `axis_name` manual and the staged parameters sharded by
  `lm_stage_specs`. The local batch is split into `schedule.num_microbatches`
  micro-batches; the loss and its gradient equal the unpipelined LM's on the whole batch.

  >>> from jax.sharding import PartitionSpec as P
  >>> from jaxcomm import train
  >>> from jaxcomm.models import lm_loss
  >>> mesh = train.make_mesh({"pipeline": 2, "data": 4})
  >>> lm = TransformerLM(d_model=8, num_layers=2, num_heads=2, d_ff=16, max_len=4)
  >>> params = lm.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  >>> staged = lm_stage_params(params, 2)
  >>> loss_fn = lm_loss_pipeline(lm, parallel.schedule_gpipe(2, 2))
  >>> f = jax.jit(jax.shard_map(loss_fn, mesh=mesh, in_specs=(lm_stage_specs(staged), P()),
  ...                           out_specs=P(), axis_names={"pipeline"}))
  >>> tokens = jnp.arange(10).reshape(2, 5) % 7
  >>> bool(jnp.allclose(f(staged, {"tokens": tokens}), lm_loss(lm)(params, {"tokens": tokens})))
  True
  """
  if model.num_layers % schedule.num_stages:
    raise ValueError(f"num_layers ({model.num_layers}) must be divisible by the number of "
                     f"pipeline stages ({schedule.num_stages}).")
  per = model.num_layers // schedule.num_stages
  block = Block(model.d_model, model.num_heads, model.d_ff, model.attention_fn, remat=model.remat)

  def first_fn(params, tokens):  # tokens: i32[B/M, T+1]
    return embed_forward(params["shared"], tokens[:, :-1])

  def stage_fn(params, x):  # x: f32[B/M, T, D]; stage leaves: [1, L/S, ...] on this device
    for j in range(per):
      x = block.apply({"params": jax.tree.map(lambda a, j=j: a[0, j], params["stages"])}, x)
    return x

  def last_fn(params, x, tokens):
    logits = head_forward(params["shared"], x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  loss = parallel.pipeline_loss(first_fn, stage_fn, last_fn, schedule, axis_name)

  def loss_fn(staged_params, batch):
    tokens = batch["tokens"]
    m = schedule.num_microbatches
    if tokens.shape[0] % m:
      raise ValueError(f"the per-device batch ({tokens.shape[0]}) must be divisible by "
                       f"num_microbatches ({m}).")
    return loss(staged_params, tokens.reshape(m, -1, *tokens.shape[1:]))

  return loss_fn


def lm_pipeline_activation_bytes(model: TransformerLM, microbatch: int, seq_len: int) -> int:
  """Bytes of one micro-batch's boundary activation f32[B/M, T, D] (what a ppermute moves).

  Example:
    >>> lm = TransformerLM(d_model=16, num_layers=2, num_heads=2, d_ff=32, max_len=8)
    >>> lm_pipeline_activation_bytes(lm, microbatch=2, seq_len=8)  # f32[2, 8, 16]
    1024
  """
  return microbatch * seq_len * model.d_model * 4


def lm_shared_bytes(staged: Any) -> int:
  """Bytes of the shared (all-reduced over the pipeline axis) parameters.

  Example:
    >>> lm = TransformerLM(d_model=8, num_layers=2, num_heads=2, d_ff=16, max_len=4)
    >>> params = lm.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    >>> staged = lm_stage_params(params, 2)
    >>> lm_shared_bytes(staged)  # embeddings, head, final norm
    17600
  """
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(staged["shared"]))
