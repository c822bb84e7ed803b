"""Muon over sharded parameters: Newton-Schulz on whole matrices whose blocks sit on several
devices of a replica.

Muon orthogonalises each weight matrix's momentum with a few Newton-Schulz iterations, which
need the whole matrix. Inside a replica laid out over `fsdp` / `tensor` a device holds one
block of it. Two ways to run the iteration on blocks (`STRATEGIES`):

* "owner": every matrix gets one owner among the devices that shard it (largest first, each
  to the least loaded device: round-robin when the matrices are equal). One all-to-all
  brings each owner the blocks of its matrices, the owner runs optax's Newton-Schulz on the
  whole matrix, and a second all-to-all brings every device its block of the result: the
  matrix once in and its update once out.
* "gram": every device iterates on its own block. Per iteration the blocks are all-gathered
  over the axes splitting the rows and the Gram matrix X X^T (rows x rows, the shorter side)
  is all-reduced over the axes splitting the columns; this is what automatic partitioning
  of optax's Newton-Schulz does, five times per step.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.sync import _mean
from jaxcomm.sync import _shards

STRATEGIES = ("owner", "gram")
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # optax.contrib.muon's default Newton-Schulz quintic


class MuonState(NamedTuple):
  """State of `muon`'s matrix stage (the other leaves are AdamW's)."""
  count: jax.Array   # i32[]: updates done
  mu: Any            # like the matrix leaves: momentum (sharded like the parameters)
  wire_bytes: dict   # {axes label: u32[]}: cumulative bytes sent over those inner axes


class _Leaf(NamedTuple):
  """One matrix leaf: its whole shape, the mesh axes splitting each dimension (size > 1)."""
  shape: tuple       # the whole tensor's shape
  dims: tuple        # per dimension, the mesh axes splitting it
  dim_nums: Any      # MuonDimensionNumbers

  @property
  def axes(self) -> tuple:
    return tuple(sorted({a for d in self.dims for a in d}))


def _label(axes) -> str:
  return "+".join(sorted(axes))


def _add(wire: dict, axes: tuple, nbytes: float) -> None:
  if axes:
    wire[_label(axes)] = wire.get(_label(axes), 0.0) + nbytes


def _axis_index(axes: tuple) -> jax.Array:
  """Row-major index of this device over `axes` (the order of a collective over them)."""
  index = jnp.zeros((), jnp.int32)
  for a in axes:
    index = index * lax.axis_size(a) + lax.axis_index(a)
  return index


def _leaves_of(tree, param_specs, dim_nums: list) -> list:
  """The static description of every leaf of `tree` (call inside shard_map when sharded)."""
  leaves = jax.tree.leaves(tree)
  specs = _shards.spec_leaves(param_specs, tree)
  out = []
  for x, spec, dn in zip(leaves, specs, dim_nums):
    dims = _shards.dim_axes(spec, len(jnp.shape(x)))
    dims = tuple(tuple(a for a in d if lax.axis_size(a) > 1) for d in dims)
    out.append(_Leaf(_shards.global_shape(jnp.shape(x), dims), dims, dn))
  return out


def _view_axes(ndim: int, dim_nums: MuonDimensionNumbers) -> tuple[tuple, tuple, tuple]:
  """(batch, reduction, output) dimensions of optax's matrix view of an ndim tensor."""
  as_tuple = lambda a: tuple(d % ndim for d in ((a,) if isinstance(a, int) else a))
  red, out = as_tuple(dim_nums.reduction_axis), as_tuple(dim_nums.output_axis)
  if ndim < 2 or set(red) & set(out):
    raise ValueError(f"Muon needs a tensor of rank >= 2 and disjoint reduction and output "
                     f"axes; got rank {ndim} and {dim_nums}.")
  return tuple(sorted(set(range(ndim)) - set(red) - set(out))), red, out


def _to_matrices(x: jax.Array, dim_nums) -> tuple[jax.Array, Any]:
  """x as [batch, reduction, output] (optax's view) and the function that undoes it."""
  batch, red, out = _view_axes(x.ndim, dim_nums)
  order = batch + red + out
  size = lambda dims: math.prod(x.shape[d] for d in dims)
  unflat = tuple(x.shape[d] for d in order)
  inverse = tuple(sorted(range(x.ndim), key=lambda i: order[i]))
  undo = lambda m: m.reshape(unflat).transpose(inverse)
  return x.transpose(order).reshape(size(batch), size(red), size(out)), undo


def _fans(leaf: _Leaf) -> tuple[int, int]:
  _, red, out = _view_axes(len(leaf.shape), leaf.dim_nums)
  return math.prod(leaf.shape[d] for d in red), math.prod(leaf.shape[d] for d in out)


def _matrix_sides(leaf: _Leaf) -> tuple[tuple, tuple, bool]:
  """(dims of the rows, dims of the columns, transposed) of optax's matrix view: rows are the
  reduction dims unless they are longer than the output dims (then optax transposes)."""
  _, red, out = _view_axes(len(leaf.shape), leaf.dim_nums)
  fan_in, fan_out = _fans(leaf)
  return (out, red, True) if fan_in > fan_out else (red, out, False)


def _gram_axes(leaf: _Leaf) -> tuple[tuple, tuple]:
  rows, cols, _ = _matrix_sides(leaf)
  row_axes = tuple(a for d in rows for a in leaf.dims[d])
  col_axes = tuple(a for d in cols for a in leaf.dims[d])
  return row_axes, col_axes


def _byte_keys(leaves: list, strategy: str) -> list:
  """The axes labels the strategy sends over for these leaves (the counter's keys)."""
  keys = set()
  for leaf in leaves:
    if not leaf.axes:
      continue
    if strategy == "owner":
      keys.add(_label(leaf.axes))
    else:
      rows, cols = _gram_axes(leaf)
      keys.update(_label(a) for a in (rows, cols, rows + cols) if a)
  return sorted(keys)


def _newton_schulz(x: jax.Array, coeffs: jax.Array, ns_steps: int, eps: float) -> jax.Array:
  """optax's iteration on one whole matrix, op for op (frobenius preconditioning): X / |X|_F,
  then X <- c0 X + (c1 A + c2 A^2) X with A = X X^T, on the shorter side."""
  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  x /= jnp.linalg.norm(x, ord="fro") + eps
  coeffs = coeffs.astype(x.dtype)

  def step(x, c):
    a = x @ x.T.conj()
    b = c[1] * a + c[2] * a @ a
    return c[0] * x + b @ x

  if coeffs.ndim == 1:
    x = lax.fori_loop(0, ns_steps, lambda i, x: step(x, coeffs), x, unroll=True)
  else:
    x = lax.scan(lambda x, c: (step(x, c), None), x, coeffs)[0]
  return x.T if transposed else x


def _orthogonalize_whole(x, coeffs, ns_steps, eps, dim_nums):
  mats, undo = _to_matrices(x, dim_nums)
  return undo(jax.vmap(lambda m: _newton_schulz(m, coeffs, ns_steps, eps))(mats))


# ------------------------------------------------------------------------ owner-based
def _assemble(blocks: jax.Array, axes: tuple, dims: tuple) -> jax.Array:
  """The whole tensor from blocks[n, *local] ordered row-major over `axes`."""
  sizes = [lax.axis_size(a) for a in axes]
  local = blocks.shape[1:]
  x = blocks.reshape(*sizes, *local)
  order, whole = [], []
  for d, d_axes in enumerate(dims):
    order += [axes.index(a) for a in d_axes] + [len(axes) + d]
    whole.append(local[d] * math.prod(lax.axis_size(a) for a in d_axes))
  return x.transpose(order).reshape(whole)


def _split(whole: jax.Array, axes: tuple, dims: tuple) -> jax.Array:
  """blocks[n, *local] of a whole tensor, row-major over `axes` (inverse of `_assemble`)."""
  shape, order, pos = [], [], {}
  for d, d_axes in enumerate(dims):
    for a in d_axes:
      pos[a] = len(shape)
      shape.append(lax.axis_size(a))
    local_pos = len(shape)
    shape.append(whole.shape[d] // math.prod(lax.axis_size(a) for a in d_axes))
    order.append(local_pos)
  x = whole.reshape(shape).transpose([pos[a] for a in axes] + order)
  return x.reshape(math.prod(lax.axis_size(a) for a in axes), -1)


def _assign(sizes: list, n: int) -> list:
  """Owner of each matrix: largest first, each to the least loaded device (ties: lowest)."""
  loads, owner = [0] * n, [0] * len(sizes)
  for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
    o = min(range(n), key=lambda j: loads[j])
    owner[i] = o
    loads[o] += sizes[i]
  return owner


def _owner_group(xs: list, leaves: list, axes: tuple, ortho) -> tuple[list, float]:
  """`ortho(i, whole)` of matrices i sharded over the same `axes`, each run on its owner.

  xs[i] is this device's block of matrix i, laid out as `leaves[i].dims` says; the owner
  gets the whole matrix and returns a whole of the same shape, whose blocks come back.
  """
  n = math.prod(lax.axis_size(a) for a in axes)
  sizes = [x.size for x in xs]
  owner = _assign(sizes, n)
  owned = [[i for i in range(len(xs)) if owner[i] == o] for o in range(n)]
  width = max(sum(sizes[i] for i in mine) for mine in owned)
  dtype = jnp.result_type(*xs)

  def pack(pieces):  # list of f[n or 1, size] -> f[n or 1, width]
    rows = pieces[0].shape[0] if pieces else 1
    pad = width - sum(p.shape[1] for p in pieces)
    return jnp.concatenate(pieces + [jnp.zeros((rows, pad), dtype)], axis=1)

  # send[o]: this device's blocks of the matrices owned by o.
  send = jnp.concatenate([pack([xs[i].astype(dtype).reshape(1, -1) for i in mine])
                          for mine in owned])
  recv, nbytes_in = comm.all_to_all(send, axes)  # recv[s]: device s's blocks of mine

  def branch(mine):
    def run(recv):
      pieces, offset = [], 0
      for i in mine:
        blocks = recv[:, offset:offset + sizes[i]].reshape(n, *xs[i].shape)
        offset += sizes[i]
        whole = _assemble(blocks, axes, leaves[i].dims)
        pieces.append(_split(ortho(i, whole).astype(dtype), axes, leaves[i].dims))
      out = pack(pieces) if pieces else jnp.zeros((n, width), dtype)
      return comm.varying(out, tuple(comm.varying_axes(recv)))
    return run

  back = lax.switch(_axis_index(axes), [branch(mine) for mine in owned], recv)
  result, nbytes_out = comm.all_to_all(back, axes)  # result[o]: my blocks of o's matrices
  out, offsets = [None] * len(xs), [0] * n
  for o, mine in enumerate(owned):
    for i in mine:
      piece = result[o, offsets[o]:offsets[o] + sizes[i]]
      offsets[o] += sizes[i]
      out[i] = piece.reshape(xs[i].shape).astype(xs[i].dtype)
  return out, nbytes_in + nbytes_out


# ------------------------------------------------------------------ Gram all-reduces
def _gram_orthogonalize(x: jax.Array, leaf: _Leaf, coeffs: jax.Array, ns_steps: int,
                        eps: float, wire: dict) -> jax.Array:
  """Newton-Schulz on the block x of one matrix; `wire` collects bytes per axes label.

  The block is viewed as [batch, rows, cols] (optax's matrix view of the local block, the
  shorter side as rows). The Gram matrix is formed on the rows gathered over the axes
  splitting them, in the gather's order; that order permutes the rows of A = X X^T and of
  B = c1 A + c2 A^2 consistently, so the rows of B X this device keeps are its own.
  """
  rows, cols = _gram_axes(leaf)
  _, _, transposed = _matrix_sides(leaf)
  mat, undo = _to_matrices(x, leaf.dim_nums)  # [batch, red, out] of the local block
  if transposed:
    mat = mat.transpose(0, 2, 1)
  coeffs = coeffs.astype(mat.dtype)
  squares, nbytes = comm.sum(jnp.sum(mat * mat, axis=(1, 2)), rows + cols)
  _add(wire, rows + cols, nbytes)
  mat = mat / (jnp.sqrt(squares) + eps)[:, None, None]
  local_rows = mat.shape[1]
  for c in (coeffs if coeffs.ndim == 2 else [coeffs] * ns_steps):
    whole_rows, nbytes = comm.all_gather(mat, rows, axis=1, tiled=True)
    _add(wire, rows, nbytes)
    a, nbytes = comm.sum(whole_rows @ whole_rows.transpose(0, 2, 1), cols)
    _add(wire, cols, nbytes)
    b = c[1] * a + c[2] * a @ a
    mine = lax.dynamic_slice_in_dim(b, _axis_index(rows) * local_rows, local_rows, axis=1)
    mat = c[0] * mat + mine @ whole_rows
  if transposed:
    mat = mat.transpose(0, 2, 1)
  return undo(mat)


# ------------------------------------------------------------------------ the stages
def _orthogonalize(xs: list, leaves: list, strategy: str, coeffs, ns_steps: int,
                   eps: float) -> tuple[list, dict]:
  """Every matrix leaf orthogonalised (blocks in, blocks out) and the bytes per axes label."""
  ortho = lambda whole, dim_nums: _orthogonalize_whole(whole, coeffs, ns_steps, eps, dim_nums)
  out, wire = [None] * len(xs), {}
  groups = {}
  for i, leaf in enumerate(leaves):
    if not leaf.axes:  # a whole matrix on this device: optax's iteration as it is
      out[i] = ortho(xs[i], leaf.dim_nums)
    elif strategy == "gram":
      out[i] = _gram_orthogonalize(xs[i], leaf, coeffs, ns_steps, eps, wire)
    else:
      groups.setdefault(leaf.axes, []).append(i)
  for axes, members in groups.items():
    done, nbytes = _owner_group([xs[i] for i in members], [leaves[i] for i in members],
                                axes, lambda j, whole: ortho(whole, leaves[members[j]].dim_nums))
    _add(wire, axes, nbytes)
    for i, x in zip(members, done):
      out[i] = x
  return out, wire


def _scale_by_shape(x: jax.Array, leaf: _Leaf, consistent_rms) -> jax.Array:
  """optax's `scale_by_shape` with the whole tensor's fan-in and fan-out."""
  fan_in, fan_out = _fans(leaf)
  if consistent_rms is None:
    return jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * x
  return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms * x


def _dim_nums_of(tree, dim_nums) -> Any:
  """The MuonDimensionNumbers of each leaf of (masked) `tree`, found by tree path."""
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if dim_nums is None:
    return [MuonDimensionNumbers()] * len(paths)
  table = dict(jax.tree_util.tree_flatten_with_path(
      dim_nums, is_leaf=lambda d: isinstance(d, MuonDimensionNumbers))[0])
  return [table[tuple(p)] for p in paths]


def _matrix_stage(strategy: str, param_specs: Any, dim_nums: Any, ns_coeffs, ns_steps: int,
                  beta: float, eps: float, nesterov: bool, consistent_rms,
                  period: int = 1) -> optax.GradientTransformation:
  """optax's `scale_by_muon` + `scale_by_shape` on blocks of sharded matrices (validated).

  With `period` P > 1 (MuonBP), update t (1-based) orthogonalises the whole matrices when
  P divides t and otherwise each device's block as a matrix of its own, scaled by the
  block's shape, with no communication.
  """

  def describe(tree):
    dns = _dim_nums_of(tree, dim_nums)
    if param_specs is None:
      return [_Leaf(tuple(jnp.shape(x)), ((),) * len(jnp.shape(x)), d)
              for x, d in zip(jax.tree.leaves(tree), dns)]
    return _leaves_of(tree, param_specs, dns)

  def init_fn(params):
    keys = _byte_keys(describe(params), strategy)
    return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params),
                     wire_bytes={k: comm.zero_bytes() for k in keys})

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count_inc = optax.safe_increment(state.count)
    if nesterov:
      mu_hat = jax.tree.map(
          lambda m, g: beta * m + (1 - beta) * g,
          optax.tree.bias_correction(mu, beta, optax.safe_increment(count_inc)),
          optax.tree.bias_correction(updates, beta, count_inc))
    else:
      mu_hat = optax.tree.bias_correction(mu, beta, count_inc)
    leaves = describe(updates)
    xs, treedef = jax.tree.flatten(mu_hat)
    coeffs = jnp.asarray(ns_coeffs)
    if coeffs.ndim == 2:
      coeffs = coeffs[-ns_steps:]

    def full(xs, counters):
      out, sent = _orthogonalize(xs, leaves, strategy, coeffs, ns_steps, eps)
      if set(sent) - set(counters):
        raise AssertionError(f"bytes sent over {set(sent) - set(counters)}, not in the counter")
      return ([_scale_by_shape(x, leaf, consistent_rms) for x, leaf in zip(out, leaves)],
              {k: comm.add_bytes(c, sent.get(k, 0.0)) for k, c in counters.items()})

    def block(xs, counters):  # each device's block as a whole matrix, scaled by its shape
      return [_scale_by_shape(_orthogonalize_whole(x, coeffs, ns_steps, eps, leaf.dim_nums),
                              _Leaf(x.shape, leaf.dims, leaf.dim_nums), consistent_rms)
              for x, leaf in zip(xs, leaves)], counters

    if period == 1:
      out, wire = full(xs, state.wire_bytes)
    else:
      out, wire = comm.cond(count_inc % period == 0, full, block, xs, state.wire_bytes)
    return jax.tree.unflatten(treedef, out), MuonState(count_inc, mu, wire)

  return optax.GradientTransformation(init_fn, update_fn)


def muon(learning_rate: optax.ScalarOrSchedule, *, strategy: str = "owner",
         axis_name: comm.AxisName = None, param_specs: Any = None,
         ns_coeffs: tuple = NS_COEFFS, ns_steps: int = 5, beta: float = 0.95,
         eps: float = 1e-8, weight_decay: float = 0.0, nesterov: bool = True,
         adam_b1: float = 0.9, adam_b2: float = 0.999, adam_eps_root: float = 0.0,
         adam_weight_decay: float = 0.0,
         adam_learning_rate: optax.ScalarOrSchedule | None = None,
         muon_weight_dimension_numbers: Any = None,
         consistent_rms: float | None = None) -> optax.GradientTransformationExtraArgs:
  """Muon (`optax.contrib.muon`) on parameters sharded inside a replica, data parallel over
  `axis_name`.

  The gradient is first averaged exactly over `axis_name` (the replicas; `sync.mean`). Each
  matrix leaf (2-D by default, or the leaves `muon_weight_dimension_numbers` names) then gets
  optax's Nesterov momentum, Newton-Schulz orthogonalisation of the whole matrix, optax's
  shape scale (of the whole matrix's fan-in and fan-out), weight decay and the learning
  rate; every other leaf AdamW, as `optax.contrib.muon`. With `param_specs` (the parameters'
  PartitionSpecs, call inside shard_map) the leaves are blocks of matrices split over inner
  mesh axes (`fsdp`, `tensor`), and `strategy` says how the iteration reaches the whole
  matrix:

  * "owner": each matrix is orthogonalised by one owner among the devices splitting it
    (largest first, to the least loaded device). One all-to-all brings each owner the
    blocks of its matrices, one all-to-all takes each device its block of the result:
    per group of matrices split over the same axes (n devices, the largest owner's blocks
    of L elements), 2 (n-1)/n * n L * bytes per element.
  * "gram": each device iterates on its block; per iteration the block is all-gathered over
    the axes splitting the rows ((r-1) x the block's bytes) and the Gram matrix of the
    shorter side, m x m, all-reduced over the axes splitting the columns (2 (c-1)/c * 4 m^2
    in float32), plus one all-reduce of the squared norm (a scalar) per step.

  Momentum is stored sharded like the parameters; `wire_bytes` counts the inner-axis bytes
  per axes label ("fsdp", "fsdp+tensor", ...). With `param_specs=None` and `axis_name=None`
  this is `optax.contrib.muon` (frobenius preconditioning) exactly.

  Args:
    learning_rate: Muon's learning rate (a number or schedule).
    strategy: "owner" or "gram" (see above).
    axis_name: the axis (or tuple) of the replicas to average the gradient over; None: one.
    param_specs: a tree of PartitionSpecs like the parameters; None: unsharded leaves.
    ns_coeffs: Newton-Schulz coefficients, (a, b, c) or one triple per iteration (optax's).
    ns_steps: Newton-Schulz iterations (>= 1).
    beta: momentum decay.
    eps: added to the norm before Newton-Schulz (and AdamW's eps).
    weight_decay: decoupled weight decay of the matrices (times the learning rate).
    nesterov: Nesterov momentum (Muon and AdamW).
    adam_b1: AdamW's beta 1 for the other leaves.
    adam_b2: AdamW's beta 2.
    adam_eps_root: AdamW's eps inside the square root.
    adam_weight_decay: AdamW's weight decay.
    adam_learning_rate: AdamW's learning rate (None: `learning_rate`).
    muon_weight_dimension_numbers: None (every 2-D leaf is a matrix) or a tree like the
      parameters of `optax.contrib.MuonDimensionNumbers` (None for AdamW leaves).
    consistent_rms: None (optax's width scale sqrt(max(1, fan_out / fan_in))) or the RMS
      factor of sqrt(max(fan_in, fan_out)) * consistent_rms.

  Returns:
    An `optax.GradientTransformationExtraArgs` (chain of `sync.mean` and the partition of
    matrix and AdamW leaves).

  References:
    Jordan et al., Muon (2024); Liu et al., Muon is scalable for LLM training,
    arXiv 2502.16982; optax.contrib.muon.

  >>> import jax.numpy as jnp, optax
  >>> params = {"w": jnp.eye(2), "b": jnp.zeros(2)}
  >>> tx = muon(0.1)
  >>> updates, _ = tx.update({"w": jnp.diag(jnp.array([2.0, 1.0])), "b": jnp.ones(2)},
  ...                        tx.init(params), params)
  >>> ref = optax.contrib.muon(0.1)
  >>> ref_updates, _ = ref.update({"w": jnp.diag(jnp.array([2.0, 1.0])), "b": jnp.ones(2)},
  ...                             ref.init(params), params)
  >>> bool(jnp.all(updates["w"] == ref_updates["w"]))
  True
  """
  return chain(**locals())


def _period_learning_rate(full: Any, block: Any, period: int) -> optax.GradientTransformation:
  """Scales update t (1-based) by -`full` when `period` divides t, else by -`block` (numbers
  or schedules of the update count)."""
  as_fn = lambda lr: lr if callable(lr) else (lambda count: lr)
  full, block = as_fn(full), as_fn(block)
  return optax.scale_by_schedule(
      lambda count: -jnp.where((count + 1) % period == 0, full(count), block(count)))


def chain(learning_rate, *, strategy, axis_name, param_specs, ns_coeffs, ns_steps, beta, eps,
          weight_decay, nesterov, adam_b1, adam_b2, adam_eps_root, adam_weight_decay,
          adam_learning_rate, muon_weight_dimension_numbers, consistent_rms, period: int = 1,
          block_learning_rate: Any = None, stage: Any = None):
  """`muon`'s transform from its arguments, checked here; shared with `muonbp` and `dion2`.

  `period` > 1 and `block_learning_rate`: MuonBP's block-local steps (`_matrix_stage`).
  `stage(param_specs, coeffs, ns_steps, eps, consistent_rms)`: the matrix stage in place of
  Muon's (Dion2's); the learning rate, weight decay and AdamW leaves stay as they are.
  """
  strategy = v.one_of("strategy", strategy, STRATEGIES)
  axis_name = v.axis_name("axis_name", axis_name)
  ns_steps = v.integer("ns_steps", ns_steps, low=1)
  beta = v.number("beta", beta, low=0.0, high=1.0)
  eps = v.number("eps", eps, low=0.0)
  # Learning rates may be schedules (callables); numbers must be positive.
  if not callable(learning_rate):
    v.number("learning_rate", learning_rate, low=0.0, low_open=True)
  if adam_learning_rate is not None and not callable(adam_learning_rate):
    v.number("adam_learning_rate", adam_learning_rate, low=0.0, low_open=True)
  weight_decay = v.number("weight_decay", weight_decay, low=0.0)
  adam_b1 = v.number("adam_b1", adam_b1, low=0.0, high=1.0, high_open=True)
  adam_b2 = v.number("adam_b2", adam_b2, low=0.0, high=1.0, high_open=True)
  adam_eps_root = v.number("adam_eps_root", adam_eps_root, low=0.0)
  adam_weight_decay = v.number("adam_weight_decay", adam_weight_decay, low=0.0)
  if consistent_rms is not None:
    consistent_rms = v.number("consistent_rms", consistent_rms, low=0.0, low_open=True)
  try:
    coeffs = jnp.asarray(ns_coeffs, jnp.float32)
  except (TypeError, ValueError):  # not numbers: named like a shape mistake
    raise ValueError(f"ns_coeffs must be numbers (a, b, c) or such triples, got "
                     f"{ns_coeffs!r}.") from None
  if coeffs.ndim not in (1, 2) or coeffs.shape[-1] != 3 or (
      coeffs.ndim == 2 and coeffs.shape[0] < ns_steps):
    raise ValueError(f"ns_coeffs must be (a, b, c) or at least ns_steps={ns_steps} such "
                     f"triples; got shape {coeffs.shape}.")
  if param_specs is not None and not all(
      isinstance(s, P) for s in jax.tree.leaves(param_specs, is_leaf=lambda s: isinstance(
          s, P) or s is None)):
    raise ValueError(f"param_specs must be a tree of PartitionSpecs, got {param_specs!r}.")
  dim_nums = muon_weight_dimension_numbers
  if dim_nums is None:
    labels = lambda params: jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", params)
  else:
    if callable(dim_nums) and not isinstance(dim_nums, MuonDimensionNumbers):
      raise ValueError("muon_weight_dimension_numbers must be None or a tree of "
                       "MuonDimensionNumbers (None for AdamW leaves), not a callable.")
    labels = lambda params: jax.tree.map(
        lambda d, x: "adam" if d is None else "muon", dim_nums, params,
        is_leaf=lambda d: d is None or isinstance(d, MuonDimensionNumbers))
  if stage is None:
    stage = _matrix_stage(strategy, param_specs, dim_nums, ns_coeffs, ns_steps, beta, eps,
                          nesterov, consistent_rms, period)
  else:
    stage = stage(param_specs, coeffs, ns_steps, eps, consistent_rms)
  if period == 1:
    rate = optax.scale_by_learning_rate(learning_rate)
  else:
    rate = _period_learning_rate(learning_rate, learning_rate if block_learning_rate is None
                                 else block_learning_rate, period)
  matrices = optax.chain(stage, optax.add_decayed_weights(weight_decay), rate)
  adam = optax.adamw(learning_rate if adam_learning_rate is None else adam_learning_rate,
                     b1=adam_b1, b2=adam_b2, eps=eps, eps_root=adam_eps_root,
                     weight_decay=adam_weight_decay, nesterov=nesterov)
  return optax.with_extra_args_support(optax.chain(
      _mean.mean(axis_name), optax.partition({"muon": matrices, "adam": adam}, labels)))
