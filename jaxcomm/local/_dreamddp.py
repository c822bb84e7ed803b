"""DreamDDP: local SGD that averages a different group of layers at each inner step."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import optax

from jaxcomm import comm
from jaxcomm.local import _core
from jaxcomm.local import _periodic


class DreamddpState(NamedTuple):
  """State of `dreamddp`."""
  count: jax.Array       # i32[]: updates taken
  inner_state: Any       # the inner optimiser's state (per-worker)
  wire_bytes: jax.Array  # u32[]: cumulative bytes sent (mod 2**32)


def layer_groups(sizes: Sequence[int], num_groups: int) -> list[list[int]]:
  """Leaves (by index) in `num_groups` groups of nearly equal size, largest leaf first.

  Longest-processing-time assignment: it keeps the bytes of the largest group, the peak
  traffic of one step, close to 1/num_groups of the total.

  >>> layer_groups([8, 1, 4, 4, 1], 2)
  [[0, 1], [2, 3, 4]]
  """
  groups, load = [[] for _ in range(num_groups)], [0] * num_groups
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    g = min(range(num_groups), key=lambda g: (load[g], g))
    groups[g].append(i)
    load[g] += sizes[i]
  return [sorted(g) for g in groups]


def dreamddp(inner: optax.GradientTransformation, sync_every: int,
             axis_name: comm.AxisName = "data", *,
             participation: _core.Participation = None) -> optax.GradientTransformationExtraArgs:
  """Partial synchronisation: every layer is averaged once per H steps, a group per step.

  The parameter leaves are split into G = min(H, number of leaves) groups of nearly equal
  size; group g is averaged over the live workers after update t when t mod H = g·H//G.
  Per period the bytes are those of one all-reduce of |θ| (local SGD's), but the peak per
  step is about 1/G of it, and each group's all-reduce can overlap the next backward pass
  (the overlap itself is the hardware's; here we count the bytes). H = 1 averages every
  leaf every step: local SGD with H = 1.

  Args:
    inner: the optimiser each worker runs.
    sync_every: H >= 1, the period.
    axis_name: the mesh axis (or tuple of axes) of the workers; None for one device.
    participation: optional live-worker mask per sync; every group sync counts as one sync
      (see `local_sgd`).

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    DreamDDP, arXiv 2502.11058.

  >>> import jax.numpy as jnp, optax
  >>> tx = dreamddp(optax.sgd(1.0), sync_every=2, axis_name=None)
  >>> params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  >>> updates, state = tx.update({"a": jnp.ones(3), "b": jnp.ones(2)}, tx.init(params), params)
  >>> int(state.count)
  1
  """
  inner, sync_every, axis_name, live_fn = _core.schedule_args(inner, sync_every, axis_name,
                                                              participation)

  def schedule(params) -> optax.GradientTransformationExtraArgs:
    """The skeleton for these parameters: one slot per group of leaves."""
    sizes = [x.size for x in jax.tree.leaves(params)]
    groups = layer_groups(sizes, min(sync_every, len(sizes))) or [[]]

    def average_group(local, state, sync):
      def branch(group):  # group's own all-reduce, counted in its own branch
        def run(leaves, wire):
          avg, nbytes = _core.masked_average([leaves[i] for i in group], sync.mine,
                                             sync.total, axis_name)
          leaves = list(leaves)
          for i, x in zip(group, avg):
            leaves[i] = x
          return leaves, comm.add_bytes(wire, nbytes)
        return run

      leaves, treedef = jax.tree.flatten(local)
      leaves, wire = comm.switch(sync.slot, [branch(g) for g in groups], leaves,
                                 state.wire_bytes)
      return jax.tree.unflatten(treedef, leaves), state._replace(wire_bytes=wire), 0

    return _periodic.periodic(
        inner, sync_every, average_group, state_type=DreamddpState, axis_name=axis_name,
        participation=live_fn, offsets=[g * sync_every // len(groups)
                                        for g in range(len(groups))], name="dreamddp")

  def update_fn(updates, state, params=None, **extra_args):
    _core.require_params(params, "dreamddp")
    return schedule(params).update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(lambda params: schedule(params).init(params),
                                               update_fn)
