"""The decoder-only Transformer LM (`jaxcomm.models.TransformerLM`) on a text dataset, laid
out by the mesh: data parallel, FSDP / tensor / replica axes (`parallel.Layout`), sequence
parallel attention over a `sequence` axis, or stages over a `pipeline` axis."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import PartitionSpec as P

from .. import toolkit
from ..toolkit import MODEL_AXES, Task
from jaxcomm import data, models, parallel

SCHEDULES = {"gpipe": parallel.schedule_gpipe, "1f1b": parallel.schedule_1f1b}
# What each block keeps for the backward pass (`jaxcomm.models.TransformerLM(remat=...)`).
REMAT = ("none", "block", "dots_saveable")


def defaults():
  return ml_collections.ConfigDict(dict(
      d_model=64, num_layers=2, num_heads=4, d_ff=256,
      vocab_size=256,        # the vocabulary (>= the byte-level corpora's 256)
      # Layouts on a mesh with tensor / sequence / pipeline axes.
      sequence_parallel=False, collective_matmul=False, attention="ring", schedule="1f1b",
      microbatches=0,        # pipeline micro-batches per worker (0: one per stage)
      remat="none"))         # none | block | dots_saveable: recomputed in the backward pass


def check(s) -> None:
  """The LM's settings in range (the sizes also nnx_lm's: `check_sizes`)."""
  check_sizes(s)
  toolkit.int_at_least({"model": s}, "model.vocab_size", 1)
  toolkit.int_at_least({"model": s}, "model.microbatches", 0)
  if s.remat not in REMAT:
    raise ValueError(f"config.model.remat must be one of {', '.join(REMAT)} (what a block "
                     f"keeps for the backward pass), got {s.remat!r}.")


def check_sizes(s) -> None:
  """The sizes every LM shares (lm, nnx_lm): integers >= 1, heads dividing the width."""
  for key in ("d_model", "num_layers", "num_heads", "d_ff"):
    toolkit.int_at_least({"model": s}, f"model.{key}", 1)
  if s.d_model % s.num_heads:
    raise ValueError(f"config.model.d_model ({s.d_model}) must be divisible by "
                     f"config.model.num_heads ({s.num_heads}).")


def text_only(ctx, name: str) -> None:
  """Refuses a dataset that is not text (an LM reads tokens)."""
  if ctx.config.data.name.startswith("folder:"):
    return
  if isinstance(ctx.dataset(), (data.ArrayDataset, data.SyntheticImages)):
    raise ValueError(f"config.model.name {name!r} needs a text dataset (pydoc, stdlib, "
                     f"text:<file>, folder:<path>), got config.data.name "
                     f"{ctx.config.data.name!r}.")


def layout(s, mesh, c):
  """The LM's `parallel.Layout` on a mesh with fsdp / tensor / replica axes, else None."""
  shape = dict(mesh.shape)
  if {"replica", "fsdp", "tensor"} & set(shape) and not {"sequence", "pipeline"} & set(shape):
    try:
      return parallel.Layout(mesh, sequence_parallel=s.sequence_parallel,
                             collective_matmul=s.collective_matmul)
    except ValueError as e:
      raise ValueError(f"config.model / config.mesh: {e}") from None
  for option in ("sequence_parallel", "collective_matmul"):
    if s[option]:
      raise ValueError(f"config.model.{option} needs the LM on a mesh with a 'tensor' axis, "
                       f"got config.mesh {c.mesh!r}.")
  return None


def build(s, ctx) -> Task:
  text_only(ctx, "lm")
  c, shape = ctx.config, ctx.mesh_shape
  stored = not c.data.name.startswith("folder:")
  vocab = ctx.dataset().vocab_size if stored else 256  # a folder of text files: bytes
  if s.vocab_size < vocab:
    raise ValueError(f"config.model.vocab_size ({s.vocab_size}) must hold the "
                     f"dataset's {vocab} tokens (config.data.name {c.data.name!r}).")
  sizes = dict(vocab_size=s.vocab_size, d_model=s.d_model, num_layers=s.num_layers,
               num_heads=s.num_heads, d_ff=s.d_ff, max_len=c.data.seq_len, remat=s.remat)
  tokens = jnp.zeros((1, c.data.seq_len), jnp.int32)
  if "sequence" in shape:
    return _sequence(s, ctx, sizes, tokens)
  if "pipeline" in shape:
    return _pipeline(s, ctx, sizes, tokens)
  model = models.TransformerLM(**sizes, layout=ctx.layout) if ctx.layout is not None else \
      models.TransformerLM(**sizes)
  if ctx.layout is None and not ctx.abstract:
    params = _init(tuple(sorted(sizes.items())))(ctx.key, tokens)
  else:
    params = ctx.init(model.init)(ctx.key, tokens)
  specs = None if ctx.layout is None else ctx.layout.param_specs(model.param_axes(), params)
  return Task(model=model, loss_fn=models.lm_loss(model), has_aux=False, params=params,
              batches=ctx.batches, specs=specs)


@functools.lru_cache(maxsize=8)
def _init(sizes: tuple):
  """The plain LM's init, jitted once per shape: the many runs of one program (every method
  and seed of experiments/compare/) share one compiled init instead of tracing their own."""
  return jax.jit(models.TransformerLM(**dict(sizes)).init)


def _sequence(s, ctx, sizes, tokens) -> Task:
  """The LM with its sequence split over the `sequence` axis (sequence-parallel attention)."""
  shape = ctx.mesh_shape
  w, kind = shape["sequence"], s.attention
  try:
    models.check_sequence_layout(ctx.config.data.seq_len, s.num_heads, w, kind)
  except ValueError as e:
    raise ValueError(f"config.model.attention / data.seq_len: {e}") from None
  model = models.TransformerLM(**sizes, attention_fn=models.sequence_attention(kind))
  params = ctx.init(models.TransformerLM(**sizes).init)(ctx.key, tokens)
  zigzag = kind == "ring_zigzag"
  batches = ctx.batches
  return Task(model=model, loss_fn=models.lm_loss_sequence(model), has_aux=False,
              params=params, batch_specs=P(tuple(a for a in shape if a not in MODEL_AXES),
                                           "sequence"),
              batches=lambda t: models.lm_sequence_batch(batches(t)["tokens"], w,
                                                         zigzag=zigzag))


def _pipeline(s, ctx, sizes, tokens) -> Task:
  """The LM with its layers split into stages over the `pipeline` axis."""
  c, shape = ctx.config, ctx.mesh_shape
  stages = shape["pipeline"]
  toolkit.one_of({"model": s}, "model.schedule", SCHEDULES)
  micro = s.microbatches or stages
  workers = math.prod(n for a, n in shape.items() if a != "pipeline")
  per_worker = c.data.batch_size // workers
  if per_worker % micro:
    raise ValueError(f"config.data.batch_size ({c.data.batch_size}) must split into "
                     f"{workers} workers x config.model.microbatches ({micro}).")
  if s.num_layers % stages:
    raise ValueError(f"config.model.num_layers ({s.num_layers}) must be divisible by "
                     f"the {stages} pipeline stages of config.mesh.")
  try:
    schedule = SCHEDULES[s.schedule](stages, micro)
  except ValueError as e:
    raise ValueError(f"config.model.schedule: {e}") from None
  model = models.TransformerLM(**sizes)
  staged = ctx.init(lambda k, t: models.lm_stage_params(model.init(k, t), stages))(ctx.key,
                                                                                    tokens)
  return Task(model=model, loss_fn=models.lm_loss_pipeline(model, schedule), has_aux=False,
              params=staged, batches=ctx.batches, specs=models.lm_stage_specs(staged))
