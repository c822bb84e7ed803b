"""Decoupled DiLoCo: learners that never wait, a syncer that merges fragments by quorum."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm
from jaxcomm.local import _core
from jaxcomm.local import _diloco
from jaxcomm.local import _transport
from jaxcomm.local._fragments import _deal, _undeal


class DecoupledSchedule(NamedTuple):
  """What happens at each tick of a Decoupled DiLoCo run, for T ticks and M learners.

  Built on the simulated clock by `jaxcomm.sim.decoupled_schedule` (learner speeds,
  failures, the syncer's quorum and grace window). Within a tick: the busy learners' inner
  steps, their deliveries, the merge, the receipts, the rejoins, in that order.
  """
  busy: np.ndarray      # bool[T, M]: learner m completes an inner step
  deliver: np.ndarray   # i32[T, M]: the fragment learner m delivers after its step (-1: none)
  merge: np.ndarray     # i32[T]: the fragment the syncer merges (-1: none)
  weight: np.ndarray    # f32[T, M]: learner m's token weight in the merge (0: not in it),
                        # scaled so that equal weights are 1
  receive: np.ndarray   # bool[T, M, P]: learner m takes the syncer's fragment p
  rejoin: np.ndarray    # bool[T, M]: learner m starts again from the syncer's fragments
  time: np.ndarray      # f64[T]: simulated seconds of the tick
  step: np.ndarray      # i32[T, M]: the learner's step number (its batch), -1 when not busy


class DecoupledDilocoState(NamedTuple):
  """State of `decoupled_diloco` (P fragments of m elements each)."""
  count: jax.Array         # i32[]: ticks taken
  inner_state: Any         # the inner optimiser's state (per-worker)
  outer_params: jax.Array  # f32[P, m]: the syncer's fragments Θ (replicated)
  outer_state: Any         # the outer optimiser's state per fragment, leading axis P
  sent: jax.Array          # f32[P, m]: the learner's last delivery of each fragment, held by
                           # the syncer until merged (per-worker)
  key: jax.Array           # PRNG key shared by all workers, for stochastic codecs
  wire_bytes: jax.Array    # u32[]: cumulative bytes sent (mod 2**32)


def _check_schedule(schedule: DecoupledSchedule, fragments: int) -> DecoupledSchedule:
  v.instance("schedule", schedule, DecoupledSchedule,
             "jaxcomm.local.DecoupledSchedule (from jaxcomm.sim.decoupled_schedule)")
  busy = np.asarray(schedule.busy, bool)
  if busy.ndim != 2 or busy.shape[0] < 1:
    raise ValueError(f"schedule.busy must be bool[ticks, learners], got shape {busy.shape}.")
  t, m = busy.shape
  receive = np.asarray(schedule.receive, bool)
  if receive.shape != (t, m, fragments):
    raise ValueError(f"schedule.receive must be bool[{t}, {m}, fragments={fragments}], got "
                     f"shape {receive.shape}.")
  merge = np.asarray(schedule.merge, np.int32)
  deliver = np.asarray(schedule.deliver, np.int32)
  for name, arr in (("merge", merge), ("deliver", deliver)):
    if arr.min(initial=-1) < -1 or arr.max(initial=-1) >= fragments:
      raise ValueError(f"schedule.{name} must hold fragments in [0, {fragments}) or -1.")
  return schedule._replace(busy=busy, deliver=deliver, merge=merge, receive=receive,
                           weight=np.asarray(schedule.weight, np.float32),
                           rejoin=np.asarray(schedule.rejoin, bool))


def decoupled_diloco(inner: optax.GradientTransformation, outer: optax.GradientTransformation,
                     schedule: DecoupledSchedule, fragments: int = 1, alpha: float = 0.0,
                     axis_name: comm.AxisName = "data", *,
                     codec: codecs.CodecLike | None = None, collective: str | None = None,
                     key: jax.Array | None = None) -> optax.GradientTransformationExtraArgs:
  """Decoupled DiLoCo: asynchronous learners, a syncer merging fragments once a quorum has them.

  Every worker of `axis_name` is a learner; one `update` is one tick of `schedule`. The
  flattened parameters are dealt into P fragments as in `streaming_diloco`. At a tick:

  * learners the schedule marks busy take their inner step (the others, slower or down, keep
    parameters and inner state: learners never wait for each other, they just finish their
    steps at other ticks);
  * a learner that delivers fragment p hands the syncer its θ_m,p (`sent`, held until
    merged; a later delivery of the same fragment replaces it);
  * when the schedule merges fragment p, Δ_p = Σ_m w_m (Θ_p − sent_m,p) / Σ_m w_m over the
    learners whose deliveries the merge includes, with token weights w_m (the tokens the
    learner processed since it last took fragment p), and the outer optimiser (Nesterov
    SGD in the paper) steps Θ_p; the weighted sum is one all-reduce of a fragment;
  * a learner that receives fragment p mixes θ_m,p ← α θ_m,p + (1 − α) Θ_p;
  * a learner back from a failure starts again from Θ (every fragment) with fresh inner
    state.

  Which learner steps, delivers and receives when, and when the syncer merges (a minimum
  quorum has delivered, then a grace window), comes from the simulated clock
  (`jaxcomm.sim.decoupled_schedule`). With every learner in every quorum, equal speeds and
  no failures the schedule is Streaming DiLoCo's and so are the numbers.

  Args:
    inner: the optimiser each learner runs.
    outer: the syncer's outer optimiser; one state per fragment.
    schedule: the ticks (`DecoupledSchedule`); its learners must be the workers of
      `axis_name`.
    fragments: P, the number of fragments the schedule uses.
    alpha: mixing weight of the learner's own fragment when it takes the syncer's, in [0, 1].
    axis_name: the mesh axis (or tuple of axes) of the learners; None for one learner.
    codec: None (float32) or the outer gradient's codec, as in `streaming_diloco`.
    collective: how the codec's payloads travel (None, "gather", "two_phase").
    key: PRNG key of stochastic codecs; None is `jax.random.key(0)`.

  Returns:
    An `optax.GradientTransformationExtraArgs` that needs `params` in `update`.

  References:
    Douillard et al., Decoupled DiLoCo for Resilient Distributed Pre-training, arXiv
    2604.21428; Streaming DiLoCo, arXiv 2501.18512.

  >>> import jax.numpy as jnp, optax
  >>> from jaxcomm import sim
  >>> s = sim.decoupled_schedule([[1.0]], fragments=2, sync_every=2, horizon_s=4.0)
  >>> tx = decoupled_diloco(optax.sgd(0.1), optax.sgd(1.0), s, fragments=2, axis_name=None)
  >>> tx.init({"a": jnp.ones(2), "b": jnp.ones(2)}).outer_params.shape
  (2, 2)
  """
  inner, _, axis_name, _ = _core.schedule_args(inner, 1, axis_name, None)
  outer = v.transform("outer", outer)
  fragments = v.integer("fragments", fragments, low=1)
  alpha = v.number("alpha", alpha, low=0.0, high=1.0)
  sch = _check_schedule(schedule, fragments)
  codec = _transport.check_codec(codec)
  collective = _transport.check_collective(collective, codec)
  key = v.key("key", key)
  ticks, learners = sch.busy.shape
  tables = {name: jnp.asarray(getattr(sch, name)) for name in (
      "busy", "deliver", "merge", "weight", "receive", "rejoin")}

  def init_fn(params):
    outer_params = _deal(codecs.flatten(params)[0], fragments)
    if codec is not None:
      codecs.for_tree(codec, outer_params[0])
    return DecoupledDilocoState(
        count=jnp.zeros((), jnp.int32), inner_state=inner.init(params),
        outer_params=outer_params, outer_state=jax.vmap(outer.init)(outer_params),
        sent=jnp.zeros_like(outer_params), key=key, wire_bytes=comm.zero_bytes())

  def merge_fn(q, row, sent, outer_params, outer_state, key, wire):
    key, sub = jax.random.split(key)
    mine = row[_core.worker_index(axis_name)]
    grad, _, nbytes = _diloco.outer_gradient(outer_params[q], sent[q], mine, row,
                                             jnp.sum(row), None, sub, codec, axis_name,
                                             collective=collective)
    frag_state = jax.tree.map(lambda x: x[q], outer_state)
    step, frag_state = outer.update(grad, frag_state, outer_params[q])
    outer_params = outer_params.at[q].set(optax.apply_updates(outer_params[q], step))
    outer_state = jax.tree.map(lambda x, y: x.at[q].set(y), outer_state, frag_state)
    return outer_params, outer_state, key, comm.add_bytes(wire, nbytes)

  def update_fn(updates, state, params=None, **extra_args):
    comm.require_varying(updates, axis_name, "local.decoupled_diloco")
    _core.require_params(params, "decoupled_diloco")
    _core.check_width("schedule", learners, axis_name)
    i = jnp.minimum(state.count, ticks - 1)
    me = _core.worker_index(axis_name)
    busy = tables["busy"][i, me] & (state.count < ticks)
    inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    inner_updates = jax.tree.map(lambda u: jnp.where(busy, u, jnp.zeros_like(u)), inner_updates)
    inner_state = jax.tree.map(lambda n, o: jnp.where(busy, n, o), inner_state,
                               state.inner_state)
    vec, unflatten = codecs.flatten(optax.apply_updates(params, inner_updates))
    mat = _deal(vec, fragments)
    d = tables["deliver"][i, me]
    sent = jnp.where(d >= 0, state.sent.at[jnp.maximum(d, 0)].set(
        mat[jnp.maximum(d, 0)]), state.sent)
    q = tables["merge"][i]
    outer_params, outer_state, key, wire = comm.cond(
        (q >= 0) & (state.count < ticks),
        lambda *ops: merge_fn(jnp.maximum(q, 0), tables["weight"][i], sent, *ops),
        lambda *ops: ops, state.outer_params, state.outer_state, state.key, state.wire_bytes)
    take = tables["receive"][i, me][:, None]
    mat = jnp.where(take, alpha * mat + (1.0 - alpha) * outer_params, mat)
    back = tables["rejoin"][i, me]
    mat = jnp.where(back, outer_params, mat)
    local = unflatten(_undeal(mat, vec.shape[0]))
    inner_state = jax.tree.map(lambda n, f: jnp.where(back, f, n), inner_state,
                               inner.init(local))
    return _core.updates_to(local, params), DecoupledDilocoState(
        state.count + 1, inner_state, outer_params, outer_state, sent, key, wire)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
