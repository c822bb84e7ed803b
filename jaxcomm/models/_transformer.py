"""A small decoder-only transformer language model (pre-norm, learned positions).

The model takes a `jaxcomm.parallel.Layout`. Without one (or with a data-parallel one) it is
the plain single-device model. With one, `apply` runs inside `shard_map` on the layout's
mesh on each device's parameter shards (as `Trainer` does): heads and MLP columns split over
`tensor` (Megatron), optionally sequence-parallel, and parameters stored sharded over the
layout's gather axes (`fsdp`) gathered one layer at a time. `init` always returns the whole
parameters, identical for every layout; `param_axes()` names each parameter's dimensions
so that `layout.param_specs(lm.param_axes(), params)` gives their PartitionSpecs:

    layout = parallel.Layout(parallel.make_mesh("data=2,fsdp=2,tensor=2"))
    lm = TransformerLM(layout=layout)
    params = lm.init(key, tokens)
    specs = layout.param_specs(lm.param_axes(), params)
    tx = optax.chain(sync.mean("data"),  # ZeRO-3 over fsdp, plain DP over data
                     parallel.zero(optax.adam(1e-3), 3, "fsdp", param_specs=specs,
                                   regather=lm.param_regather()))
    trainer = train.Trainer(lm_loss(lm), tx, layout.mesh, batch_axes=layout.batch_axes,
                            param_specs=specs)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm import parallel


causal_attention = parallel.causal_attention  # the single-device reference attention

# `TransformerLM(remat=...)`: what a block keeps for its backward pass (`jax.checkpoint`).
# none: every intermediate (no recomputation); block: only the block's input, the rest is
# recomputed; dots_saveable: the matrix products' outputs, the elementwise rest recomputed.
_REMAT = {"none": None, "block": jax.checkpoint_policies.nothing_saveable,
          "dots_saveable": jax.checkpoint_policies.dots_saveable}


def layer_norm(x, scale, bias, eps: float = 1e-6):
  """LayerNorm over the last dimension (float32 statistics)."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + eps) * scale + bias


_kernel = nn.initializers.lecun_normal
_zeros = nn.initializers.zeros
_ones = nn.initializers.ones


class _Param(NamedTuple):
  """How one parameter is declared."""
  shape: tuple     # whole shape
  axes: tuple      # logical name of each dimension (the rules map them to mesh axes)
  init: Callable   # initializer
  # Whether any gradient of its layer reads its value. Under FSDP only these are gathered
  # again in the backward pass (embedding tables, and a bias added last, are not read).
  regather: bool = True


def _block_table(d, h, dh, f):
  """name -> leaf -> _Param for one block."""
  norm = lambda: {"scale": _Param((d,), ("norm",), _ones), "bias": _Param((d,), ("norm",), _zeros)}
  return {
      "ln_attn": norm(),
      "qkv": {"kernel": _Param((d, 3, h, dh), ("embed", "qkv", "heads", "head_dim"),
                               _kernel(in_axis=0, out_axis=(1, 2, 3))),
              "bias": _Param((3, h, dh), ("qkv", "heads", "head_dim"), _zeros)},
      "proj": {"kernel": _Param((h, dh, d), ("heads", "head_dim", "embed"),
                                _kernel(in_axis=(0, 1), out_axis=2)),
               "bias": _Param((d,), ("embed",), _zeros)},
      "ln_mlp": norm(),
      "fc_in": {"kernel": _Param((d, f), ("embed", "mlp"), _kernel()),
                "bias": _Param((f,), ("mlp",), _zeros)},
      "fc_out": {"kernel": _Param((f, d), ("mlp", "embed"), _kernel()),
                 "bias": _Param((d,), ("embed",), _zeros, regather=False)},
  }


def lm_tables(vocab_size: int, d_model: int, num_heads: int, d_ff: int, max_len: int):
  """(embed, block, head) tables of the LM's parameters (shared by the linen and NNX LMs)."""
  d, v = d_model, vocab_size
  embed_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
  embed = {"embed": {"embedding": _Param((v, d), ("vocab", "embed"), embed_init, False)},
           "pos": _Param((max_len, d), ("length", "embed"), nn.initializers.normal(0.02),
                         False)}
  head = {"ln_f": {"scale": _Param((d,), ("norm",), _ones),
                   "bias": _Param((d,), ("norm",), _zeros)},
          "head": {"kernel": _Param((d, v), ("embed", "vocab"), _kernel()),
                   "bias": _Param((v,), ("vocab",), _zeros, regather=False)}}
  return embed, _block_table(d, num_heads, d // num_heads, d_ff), head


def _field(table, name):
  return jax.tree.map(lambda e: getattr(e, name), table, is_leaf=lambda e: isinstance(e, _Param))


def _declare(module: nn.Module, table: dict, layout) -> dict:
  """Declares every group of `table` as a dict-valued param: whole at init, shards in apply."""
  local = layout is not None and not module.is_initializing()
  shape = lambda e: layout.local_shape(e.shape, e.axes) if local else e.shape
  out = {}
  for name, group in table.items():
    if isinstance(group, _Param):  # an array parameter
      out[name] = module.param(name, group.init, shape(group))
      continue

    def init(key, group=group):
      keys = dict(zip(group, jax.random.split(key, len(group))))
      return {leaf: e.init(keys[leaf], shape(e)) for leaf, e in group.items()}
    out[name] = module.param(name, init)
  return out


def _run(layout, table, fn, params, *inputs):
  """Runs a layer on parameter shards: gathered per call over the layout's gather axes."""
  if layout is None:
    return fn(params, *inputs)
  shapes = jax.tree.map(lambda e: jax.ShapeDtypeStruct(e.shape, jnp.float32), table,
                        is_leaf=lambda e: isinstance(e, _Param))
  specs = layout.param_specs(_field(table, "axes"), shapes, max_replicated=1.0)
  layer = parallel.fsdp(fn, specs, layout.gather_axes or None,
                        regather=_field(table, "regather"))
  return layer(params, *inputs)


def block_forward(p: dict, x: jax.Array, *, attention_fn: Callable = causal_attention,
                  layout: Any = None, dropout: Callable | None = None) -> jax.Array:
  """One pre-norm block on whole (or tensor-sharded) parameters `p`.

  `dropout`, when given, is applied to the attention and MLP outputs before each residual
  add (the NNX LM passes its `nnx.Dropout`).
  """
  axis = layout.tensor_axis if layout is not None else None
  sp = dict(sequence_parallel=layout is not None and layout.sequence_parallel,
            collective_matmul=layout is not None and layout.collective_matmul)
  drop = dropout if dropout is not None else (lambda y: y)
  h = layer_norm(x, **p["ln_attn"])
  x = x + drop(parallel.attention_tp(h, p["qkv"], p["proj"], axis, attention_fn, **sp))
  h = layer_norm(x, **p["ln_mlp"])
  return x + drop(parallel.mlp_tp(h, p["fc_in"], p["fc_out"], axis, **sp))


class Block(nn.Module):
  """Pre-norm attention + MLP block. `attention_fn` is the swappable attention kernel."""
  d_model: int
  num_heads: int
  d_ff: int
  attention_fn: Callable = causal_attention
  layout: Any = None
  remat: str = "none"

  def table(self) -> dict:
    dh = self.d_model // self.num_heads
    return _block_table(self.d_model, self.num_heads, dh, self.d_ff)

  @nn.compact
  def __call__(self, x):
    table = self.table()
    params = _declare(self, table, self.layout)
    fn = functools.partial(block_forward, attention_fn=self.attention_fn, layout=self.layout)
    if _REMAT[self.remat] is not None:
      fn = jax.checkpoint(fn, policy=_REMAT[self.remat])
    return _run(self.layout, table, fn, params, x)


def embed_forward(p: dict, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
  """Token embeddings plus learned positions (0..T-1, or `positions`): f32[B, T, D]."""
  pos = p["pos"][:tokens.shape[1]] if positions is None else p["pos"][positions]
  return p["embed"]["embedding"][tokens] + pos


def head_forward(p: dict, x: jax.Array) -> jax.Array:
  """Final norm and the vocabulary projection: logits f32[B, T, V]."""
  x = layer_norm(x, **p["ln_f"])
  return jnp.tensordot(x, p["head"]["kernel"], axes=1) + p["head"]["bias"]


class TransformerLM(nn.Module):
  """Decoder-only LM over a byte vocabulary, laid out by an optional `parallel.Layout`.

  `remat` is what each block keeps for the backward pass (`jax.checkpoint`): "none" (every
  intermediate), "block" (only its input; the block is recomputed) or "dots_saveable" (the
  matrix products' outputs; the elementwise rest is recomputed). The values and gradients
  are the same; the peak memory and the FLOPs are not. Under an FSDP layout each block's
  layer is recomputed in the backward pass anyway (`parallel.fsdp`).

  >>> import jax, jax.numpy as jnp
  >>> lm = TransformerLM(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=16)
  >>> params = lm.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  >>> lm.apply(params, jnp.zeros((2, 16), jnp.int32)).shape
  (2, 16, 256)
  """
  vocab_size: int = 256
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  d_ff: int = 256
  max_len: int = 128
  attention_fn: Callable = causal_attention
  layout: Any = None
  remat: str = "none"

  def __post_init__(self):
    v.one_of("remat", self.remat, tuple(_REMAT))
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads "
                       f"({self.num_heads}).")
    if self.layout is not None:
      tp = self.layout.size("tensor")
      if self.num_heads % tp or self.d_ff % tp:
        raise ValueError(f"num_heads ({self.num_heads}) and d_ff ({self.d_ff}) must be "
                         f"divisible by the tensor axis size ({tp}).")
      for axis in ("sequence", "pipeline"):
        if self.layout.size(axis) > 1:
          raise ValueError(f"TransformerLM has no {axis}-parallel form yet; the mesh axis "
                           f"{axis!r} must have size 1, got {self.layout.size(axis)}.")
    super().__post_init__()

  def _tables(self):
    return lm_tables(self.vocab_size, self.d_model, self.num_heads, self.d_ff, self.max_len)

  def param_axes(self) -> dict:
    """Logical names of every parameter's dimensions: `{"params": {...}}` like `init`'s."""
    embed, block, head = self._tables()
    return self._param_tree(lambda table: _field(table, "axes"))

  def param_regather(self) -> dict:
    """Which parameters FSDP gathers again in the backward pass (see `zero(regather=)`)."""
    return self._param_tree(lambda table: _field(table, "regather"))

  def _param_tree(self, field):
    embed, block, head = self._tables()
    blocks = {f"block{i}": field(block) for i in range(self.num_layers)}
    return {"params": {**field(embed), **blocks, **field(head)}}

  @nn.compact
  def __call__(self, tokens, positions=None):
    """Logits f32[B, T, V] for tokens i32[B, T] at `positions` i32[B, T] (default 0..T-1).

    Positions are given when the tokens are one shard of a longer sequence.
    """
    # `init` runs outside shard_map: it builds the whole parameters with the plain model.
    layout = None if self.is_initializing() else self.layout
    embed, _, head = self._tables()
    t = tokens.shape[1]
    x = _run(layout, embed, embed_forward, _declare(self, embed, layout), tokens, positions)
    tp = layout.tensor_axis if layout is not None else None
    sp = layout is not None and layout.sequence_parallel
    if sp:  # Between blocks each tensor device keeps its slice of the sequence.
      n = layout.size(tp)
      if t % n:
        raise ValueError(f"sequence length {t} must be divisible by the tensor axis size {n} "
                         "with sequence_parallel.")
      x = lax.dynamic_slice_in_dim(x, lax.axis_index(tp) * (t // n), t // n, axis=1)
    for i in range(self.num_layers):
      x = Block(self.d_model, self.num_heads, self.d_ff, self.attention_fn, layout, self.remat,
                name=f"block{i}")(x)
    if sp:  # Invariant gather: the head then runs once per tensor group, not T times.
      x, _ = comm.all_gather(x, tp, axis=1, tiled=True)
    return _run(layout, head, head_forward, _declare(self, head, layout), x)


def lm_loss(model: nn.Module):
  """`loss(params, batch) -> mean next-token cross-entropy` for `{'tokens': i32[B, T+1]}`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> lm = TransformerLM(d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=8)
    >>> params = lm.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    >>> loss = lm_loss(lm)(params, {"tokens": jnp.zeros((2, 9), jnp.int32)})
    >>> loss.shape, bool(loss > 0)
    ((), True)
  """

  return lambda params, batch: next_token_loss(lambda x: model.apply(params, x), batch)


def next_token_loss(logits_fn: Callable, batch: dict) -> jax.Array:
  """Mean next-token cross-entropy of `logits_fn(tokens[:, :-1])` against `tokens[:, 1:]`."""
  tokens = batch["tokens"]
  logits = logits_fn(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
