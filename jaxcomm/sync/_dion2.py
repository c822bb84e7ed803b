"""Dion2: Newton-Schulz on the fraction alpha of a matrix's rows (or columns) that matter most.

Per matrix (a Flax kernel, fan_in x fan_out) with accumulator M:
  B = M + G;  S = the k = ceil(alpha x d) slices along the shorter side d with the largest L1
  norms;  O = NS(B[S]);  M <- B with B[S] scaled by `ef_decay`;  X[S] -= lr x scale x O,
and X <- X (1 - lr wd) everywhere. With alpha = 1 every slice is selected: M is heavy-ball
momentum and the update is Muon's without Nesterov (NS is scale-invariant), i.e.
`sync.muon(nesterov=False, beta=ef_decay)` up to float rounding.

Choices and their sources (the authors' code, `microsoft/dion` dion2.py): the slices are
selected along the shorter side (rows on a tie) by L1 norm, k = ceil(alpha x size), the
accumulator is M + G with only the selected slices decayed (`ef_decay`, 0.95), AdamW on the
other leaves, the fraction 0.25 by default. Where we deviate: Newton-Schulz is `sync.muon`'s
(optax's quintic coefficients; the authors default to Polar Express coefficients, which
`ns_coeffs` accepts as a per-iteration table) and so is the shape scale (optax's
sqrt(max(1, fan_out / fan_in)) or `consistent_rms`; the authors' "spectral_norm" scale is
sqrt(fan_out / fan_in)); the selected slices travel in float32 (the authors cast to bf16).

Sharded over fsdp / tensor (`param_specs`), each matrix is orthogonalised by one owner, as in
`sync.muon`'s owner strategy, but the all-to-alls carry only selected slices. The slices' L1
norms are summed over the axes splitting the other side (d / s floats, s the shards of the
selected side). `selection="local"` (the default, as the authors' for sharded matrices): each
shard selects ceil(alpha d / s) of its own slices, exactly alpha of its block travels, and the
union is orthogonalised (the one-device rule applied to each of the s parts of the selected
side; with d not split, s = 1, it is the rule itself). `"global"` (the one-device rule on
the whole matrix, however it is split): the norms are gathered over the axes splitting d and
every device picks the same top k; a device sends a buffer of min(k, d / s) slices, its
selected ones first (the static worst case: alpha of its block when d is not split, but
min(alpha s, 1) when it is, e.g. the whole block at alpha = 1/4 on 4 fsdp shards).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from optax.contrib import MuonDimensionNumbers

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm.sync import _muon

SELECTIONS = ("global", "local")
_MATRIX = MuonDimensionNumbers()  # a Flax kernel: fan_in x fan_out


class Dion2State(NamedTuple):
  """State of `dion2`'s matrix stage (the other leaves are AdamW's)."""
  count: jax.Array   # i32[]: updates done
  momentum: Any      # like the matrix leaves: the accumulator M (sharded like the parameters)
  wire_bytes: dict   # {axes label: u32[]}: cumulative bytes sent over those inner axes


def _select(b, leaf, fraction: float, selection: str, wire: dict):
  """(rows [cap], valid [cap], the owner's rows of the assembled buffer or None) of the block
  b viewed [d_local, other_local]."""
  d = 0 if leaf.shape[0] <= leaf.shape[1] else 1
  sel_axes, oth_axes = leaf.dims[d], leaf.dims[1 - d]
  s = math.prod(comm.axis_size(a) for a in sel_axes)
  local = b.shape[0]
  norms, nbytes = comm.sum(jnp.sum(jnp.abs(b), axis=1), oth_axes or None)
  _muon._add(wire, oth_axes, nbytes)
  if selection == "local" and s > 1:
    k = math.ceil(fraction * local)
    return lax.top_k(norms, k)[1], jnp.ones((k,), bool), None
  k = math.ceil(fraction * leaf.shape[d])
  cap = min(k, local)
  whole, nbytes = comm.all_gather(norms, sel_axes or None, tiled=True)
  _muon._add(wire, sel_axes, nbytes)
  idx = lax.top_k(whole, k)[1]
  shard = idx // local
  mine = shard == (_muon._axis_index(sel_axes) if sel_axes else 0)
  order = jnp.argsort(~mine, stable=True)[:cap]  # my selected slices first, in idx order
  slot = jnp.sum(jnp.tril(shard[:, None] == shard[None, :], -1), axis=1)  # rank in its shard
  return idx[order] % local, mine[order], shard * cap + slot


def _stage(fraction: float, ef_decay: float, selection: str, param_specs, coeffs, ns_steps,
           eps, consistent_rms) -> optax.GradientTransformation:
  """The matrix stage: Dion2's update of every 2-D leaf (validated arguments)."""
  ns = lambda x: _muon._newton_schulz(x, coeffs, ns_steps, eps)

  def describe(tree):
    if param_specs is None:
      return [_muon._Leaf(tuple(jnp.shape(x)), ((), ()), _MATRIX) for x in jax.tree.leaves(tree)]
    return _muon._leaves_of(tree, param_specs, [_MATRIX] * len(jax.tree.leaves(tree)))

  def init_fn(params):
    keys = set()
    for leaf in describe(params):  # the owner's axes, the norms' sum and (global) gather
      d = 0 if leaf.shape[0] <= leaf.shape[1] else 1
      keys.update({leaf.axes, leaf.dims[1 - d], leaf.dims[d] if selection == "global" else ()})
    keys = sorted(_muon._label(axes) for axes in keys - {()})
    return Dion2State(count=jnp.zeros([], jnp.int32), momentum=optax.tree.zeros_like(params),
                      wire_bytes={k: comm.zero_bytes() for k in keys})

  def update_fn(updates, state, params=None):
    del params
    leaves = describe(updates)
    gs, treedef = jax.tree.flatten(updates)
    ms = jax.tree.leaves(state.momentum)
    wire, picks, moms, buffers = {}, [], [], []
    for g, m, leaf in zip(gs, ms, leaves):
      if len(leaf.shape) != 2:
        raise ValueError(f"dion2 orthogonalises 2-D matrices; got a leaf of shape "
                         f"{leaf.shape} (give such leaves to AdamW).")
      flip = leaf.shape[0] > leaf.shape[1]  # view [d, other]: d the shorter side
      b = (m + g).astype(jnp.float32)
      b = b.T if flip else b
      rows, valid, owner_rows = _select(b, leaf, fraction, selection, wire)
      moms.append(b.at[rows].multiply(jnp.where(valid, ef_decay, 1.0)[:, None]))
      buffers.append(b[rows] * valid[:, None])
      picks.append((flip, rows, valid, owner_rows))
    out = [None] * len(gs)
    groups = {}
    for i, leaf in enumerate(leaves):
      if not leaf.axes:
        out[i] = ns(buffers[i])
      else:
        groups.setdefault(leaf.axes, []).append(i)
    for axes, members in groups.items():
      views = []
      for i in members:  # the buffer as a block of [s x cap, other]: d's axes, then other's
        d = 1 if picks[i][0] else 0
        dims = (leaves[i].dims[d], leaves[i].dims[1 - d])
        views.append(_muon._Leaf((0, 0), dims, _MATRIX))

      def ortho(j, whole, members=members):
        owner_rows = picks[members[j]][3]
        if owner_rows is None:  # local selection: the union of every shard's slices
          return ns(whole)
        return jnp.zeros_like(whole).at[owner_rows].set(ns(whole[owner_rows]))

      done, nbytes = _muon._owner_group([buffers[i] for i in members], views, axes, ortho)
      _muon._add(wire, axes, nbytes)
      for i, x in zip(members, done):
        out[i] = x
    for i, (flip, rows, valid, _) in enumerate(picks):
      upd = jnp.zeros_like(moms[i]).at[rows].add(out[i] * valid[:, None])
      upd, mom = (upd.T, moms[i].T) if flip else (upd, moms[i])
      out[i] = _muon._scale_by_shape(upd, leaves[i], consistent_rms).astype(gs[i].dtype)
      moms[i] = mom.astype(ms[i].dtype)
    counters = {k: comm.add_bytes(c, wire.get(k, 0.0)) for k, c in state.wire_bytes.items()}
    if set(wire) - set(counters):
      raise AssertionError(f"bytes sent over {set(wire) - set(counters)}, not counted")
    return jax.tree.unflatten(treedef, out), Dion2State(
        optax.safe_increment(state.count), jax.tree.unflatten(treedef, moms), counters)

  return optax.GradientTransformation(init_fn, update_fn)


def dion2(learning_rate: optax.ScalarOrSchedule, fraction: float = 0.25, *,
          ef_decay: float = 0.95, selection: str = "local", axis_name: comm.AxisName = None,
          param_specs: Any = None, ns_coeffs: tuple = _muon.NS_COEFFS, ns_steps: int = 5,
          eps: float = 1e-8, weight_decay: float = 0.0, consistent_rms: float | None = None,
          adam_b1: float = 0.9, adam_b2: float = 0.999, adam_eps_root: float = 0.0,
          adam_weight_decay: float = 0.0,
          adam_learning_rate: optax.ScalarOrSchedule | None = None
          ) -> optax.GradientTransformationExtraArgs:
  """Dion2 (module docstring) on parameters sharded inside a replica, data parallel over
  `axis_name` (the replicas' mean gradient, as `sync.muon`).

  Every 2-D leaf is a matrix; the others get AdamW. Bytes per device inside a replica (per
  axes label in the state's `wire_bytes`): the norms' all-reduce and gather, and the owner's
  two all-to-alls of the selected slices (2 (n-1)/n x n x the widest owner's buffer).

  Args:
    learning_rate: the matrices' learning rate (a number or schedule).
    fraction: alpha in (0, 1], the fraction of slices orthogonalised per step.
    ef_decay: the factor the selected slices of the accumulator are multiplied by.
    selection: "local" (the top slices of each shard of the selected side) or "global"
      (of the whole matrix; see the module docstring for its bytes).
    axis_name: the replica axis (or tuple) to average the gradient over; None: one.
    param_specs: the parameters' PartitionSpecs (a tree like them); None: unsharded.
    ns_coeffs: Newton-Schulz coefficients, (a, b, c) or one triple per iteration.
    ns_steps: Newton-Schulz iterations.
    eps: added to the norm before Newton-Schulz (and AdamW's eps).
    weight_decay: decoupled weight decay of the matrices (times the learning rate).
    consistent_rms: None (optax's shape scale) or `sync.muon`'s RMS factor.
    adam_b1: AdamW's beta 1 for the other leaves.
    adam_b2: AdamW's beta 2.
    adam_eps_root: AdamW's eps inside the square root.
    adam_weight_decay: AdamW's weight decay.
    adam_learning_rate: AdamW's learning rate (None: `learning_rate`).

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  References:
    Ahn, Amsel, Langford, Dion2: A Simple Method to Shrink Matrix in Muon, arXiv 2512.16928;
    `microsoft/dion`.

  >>> import jax.numpy as jnp
  >>> params = {"w": jnp.zeros((4, 3))}
  >>> grads = {"w": jnp.array([[4.0, 0, 0], [0, 0, 0], [0, 3.0, 0], [0, 0, 1.0]])}
  >>> tx = dion2(0.1, fraction=1 / 3)  # k = 1 of the 3 columns: the first (L1 norm 4)
  >>> updates, _ = tx.update(grads, tx.init(params), params)
  >>> (updates["w"] != 0).astype(int).tolist()
  [[1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
  """
  fraction = v.number("fraction", fraction, low=0.0, high=1.0, low_open=True)
  ef_decay = v.number("ef_decay", ef_decay, low=0.0, high=1.0)
  selection = v.one_of("selection", selection, SELECTIONS)

  def stage(param_specs, coeffs, ns_steps, eps, consistent_rms):
    return _stage(fraction, ef_decay, selection, param_specs, coeffs, ns_steps, eps,
                  consistent_rms)

  return _muon.chain(
      learning_rate, strategy="owner", axis_name=axis_name, param_specs=param_specs,
      ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=ef_decay, eps=eps,
      weight_decay=weight_decay, nesterov=False, adam_b1=adam_b1, adam_b2=adam_b2,
      adam_eps_root=adam_eps_root, adam_weight_decay=adam_weight_decay,
      adam_learning_rate=adam_learning_rate, muon_weight_dimension_numbers=None,
      consistent_rms=consistent_rms, stage=stage)
