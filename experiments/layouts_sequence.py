"""Builds the LM on a mesh with a `sequence` or a `pipeline` axis (issue 8's layouts).

`experiments/train.py --mesh=data=2,sequence=4 --attention=ring` and
`--mesh=data=2,pipeline=4 --schedule=1f1b --microbatches=4` come through `build`, which
returns everything the Trainer needs. Library code never sees flags: the settings arrive in
`cfg.extra` (`mesh`, `attention`, `schedule`, `microbatches`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcomm import data, models, parallel

MESH_AXES = ("data", "sequence", "pipeline")
SCHEDULES = {"gpipe": parallel.schedule_gpipe, "1f1b": parallel.schedule_1f1b}


def parse_mesh(text: str, num_devices: int) -> dict:
  """'data=2,sequence=4' -> {'data': 2, 'sequence': 4}; '' -> {'data': num_devices}."""
  if not text:
    return {"data": num_devices}
  shape = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    if name not in MESH_AXES or not size.isdigit():
      raise ValueError(f"mesh entry {part!r} must be axis=size with axis in {MESH_AXES}.")
    shape[name] = int(size)
  if "data" not in shape:
    shape = {"data": 1, **shape}
  if math.prod(shape.values()) != num_devices:
    raise ValueError(f"mesh {shape} multiplies to {math.prod(shape.values())}, but there are "
                     f"{num_devices} devices.")
  if "sequence" in shape and "pipeline" in shape:
    raise ValueError("a mesh with both sequence and pipeline axes is not supported yet.")
  return shape


@dataclasses.dataclass
class Layout:
  """What the Trainer needs for one layout of the LM."""
  loss_fn: Callable
  params: Any                   # initial parameters (staged for the pipeline)
  batch_fn: Callable            # step -> numpy batch, already in the layout's format
  axis_name: Any                # the axes gradients are averaged over
  param_specs: Any = None
  batch_specs: Any = None


def build(cfg, mesh_shape: dict) -> Layout:
  """The LM, its loss, parameters and batches for `mesh_shape` (validated before compile)."""
  if cfg.model != "lm":
    raise ValueError(f"sequence and pipeline layouts need model 'lm', got {cfg.model!r}.")
  dataset = data.load(cfg.dataset)
  pi, pc = jax.process_index(), jax.process_count()
  raw_batch = lambda t: dataset.batch(t, cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                                      process_index=pi, process_count=pc)
  key = jax.random.key(cfg.seed)
  sizes = dict(d_model=cfg.d_model, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
               d_ff=cfg.d_ff, max_len=cfg.seq_len)
  if "sequence" in mesh_shape:
    w = mesh_shape["sequence"]
    kind = cfg.extra.get("attention") or "ring"
    models.check_sequence_layout(cfg.seq_len, cfg.num_heads, w, kind)
    lm = models.TransformerLM(**sizes, attention_fn=models.sequence_attention(kind))
    params = jax.jit(models.TransformerLM(**sizes).init)(
        key, jnp.zeros((1, cfg.seq_len), jnp.int32))
    zigzag = kind == "ring_zigzag"
    return Layout(
        loss_fn=models.lm_loss_sequence(lm), params=params,
        batch_fn=lambda t: models.lm_sequence_batch(raw_batch(t)["tokens"], w, zigzag=zigzag),
        axis_name=("data", "sequence"), batch_specs=P("data", "sequence"))
  if "pipeline" in mesh_shape:
    stages = mesh_shape["pipeline"]
    schedule_name = cfg.extra.get("schedule") or "1f1b"
    if schedule_name not in SCHEDULES:
      raise ValueError(f"schedule {schedule_name!r} is unknown; allowed: {', '.join(SCHEDULES)}.")
    micro = cfg.extra.get("microbatches") or stages
    schedule = SCHEDULES[schedule_name](stages, micro)
    per_worker = cfg.batch_size // mesh_shape["data"]
    if cfg.batch_size % mesh_shape["data"] or per_worker % micro:
      raise ValueError(f"batch_size ({cfg.batch_size}) must split into {mesh_shape['data']} "
                       f"data workers x {micro} micro-batches.")
    lm = models.TransformerLM(**sizes)
    params = jax.jit(lm.init)(key, jnp.zeros((1, cfg.seq_len), jnp.int32))
    staged = models.lm_stage_params(params, stages)
    return Layout(loss_fn=models.lm_loss_pipeline(lm, schedule), params=staged,
                  batch_fn=raw_batch, axis_name="data",
                  param_specs=models.lm_stage_specs(staged))
  raise ValueError(f"mesh {mesh_shape} has neither a sequence nor a pipeline axis.")
