"""Moving a train state between meshes of live islands: remesh, heal a joiner, gather.

A `TrainState` on a `Program`'s mesh keeps per-worker leaves with a leading worker axis
sharded over the batch axis (one row per device) and replicated leaves once per device. When
the live set changes, every surviving process still holds its own devices' rows and copies:
`remesh` places them on the new mesh without moving a byte. A process that (re)joins holds
nothing useful; `heal` gives it a live peer's state in one all-gather: the peer's parameters
and replicated optimiser state (outer parameters, outer momenta, counters, keys) bit for
bit, and fresh per-worker optimiser state (`optimizer.init` of those parameters: inner
momenta and error memories start over).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import comm
from jaxcomm.train import Program, TrainState


def remesh(state: TrainState | None, program: Program, template: TrainState) -> TrainState:
  """`state` on `program`'s mesh, from the shards this process's devices already hold.

  Devices of the new mesh that were not on `state`'s mesh (a joining island's) take the
  template's values, to be replaced by `heal`.

  Args:
    state: the train state on the previous mesh (None: nothing held yet).
    program: the program of the new mesh.
    template: a state of the new mesh (e.g. `program.init(params)`).

  Returns:
    The same values on the new mesh: per-worker rows stay on their devices.

  >>> import jax, jax.numpy as jnp, optax
  >>> from jaxcomm import local, train
  >>> tx = local.local_sgd(optax.sgd(0.1), sync_every=2)
  >>> on = lambda ids: train.make_program(lambda p, b: jnp.mean((b["x"] * p["w"]) ** 2), tx,
  ...     train.make_mesh({"data": len(ids)}, devices=[jax.devices()[i] for i in ids]),
  ...     {"w": jnp.ones(())})
  >>> p3, p2 = on([0, 1, 2]), on([0, 1])  # island 2 is gone
  >>> s3, _, _ = p3.step(p3.init({"w": jnp.ones(())}), {"x": jnp.arange(3.0)})
  >>> s2 = remesh(s3, p2, p2.init({"w": jnp.ones(())}))
  >>> rows = lambda x: np.asarray(x, np.float64).round(2).tolist()
  >>> rows(s3.params["w"]), rows(s2.params["w"])
  ([1.0, 0.8, 0.2], [1.0, 0.8])
  """
  if state is None:
    return template
  shardings = program.state_shardings()

  def one(x, like, sharding):
    held = {s.device: s.data for s in like.addressable_shards}
    held.update({s.device: s.data for s in x.addressable_shards})
    devices = list(sharding.addressable_devices_indices_map(like.shape))
    return jax.make_array_from_single_device_arrays(like.shape, sharding,
                                                    [held[d] for d in devices])

  return jax.tree.map(one, state, template, shardings)


def heal(program: Program, state: TrainState, joiners: Sequence[bool], donor: int
         ) -> TrainState:
  """Joining workers take a live worker's state; every other worker keeps its own.

  Collective over `program`'s mesh (every process calls it): each leaf is all-gathered once
  and the donor's copy taken, so what a joiner receives is a bit-for-bit copy. A joiner gets
  the donor's parameters, the donor's replicated state (for DiLoCo: the outer parameters and
  outer optimiser state, the step counter) and `optimizer.init(donor parameters)` for its
  per-worker optimiser leaves; its inner loop therefore starts from the donor's parameters,
  which right after an outer sync are the outer parameters. Replicated leaves are the
  donor's on every worker (a joiner's own copies may hold anything).

  Args:
    program: the program of the mesh.
    state: the state on that mesh; joiners' rows and copies are ignored.
    joiners: one bool per worker (mesh position along the batch axes): True to heal.
    donor: the mesh position of the worker to copy (not a joiner).

  Returns:
    The healed state.

  >>> import jax, jax.numpy as jnp, optax
  >>> from jaxcomm import local, train
  >>> tx = local.diloco(optax.sgd(0.1, momentum=0.9), optax.sgd(1.0), sync_every=1)
  >>> on = lambda ids: train.make_program(lambda p, b: jnp.mean((b["x"] * p["w"]) ** 2), tx,
  ...     train.make_mesh({"data": len(ids)}, devices=[jax.devices()[i] for i in ids]),
  ...     {"w": jnp.ones(())})
  >>> p2, p3 = on([0, 1]), on([0, 1, 2])  # island 2 comes back
  >>> s2, _, _ = p2.step(p2.init({"w": jnp.ones(())}), {"x": jnp.ones(2)})
  >>> s3 = remesh(s2, p3, p3.init({"w": jnp.zeros(())}))  # its row: the template's
  >>> s3 = heal(p3, s3, [False, False, True], donor=0)
  >>> rows = lambda x: np.asarray(x, np.float64).round(2).tolist()
  >>> rows(s3.params["w"]), rows(s3.opt_state.outer_params["w"])
  ([0.8, 0.8, 0.8], 0.8)
  >>> rows(s3.opt_state.inner_state[0].trace["w"])  # its momentum starts over
  [2.0, 2.0, 0.0]
  """
  config, layout = program.config, program.layout
  w = config.num_workers
  if len(joiners) != w or not 0 <= donor < w or joiners[donor]:
    raise ValueError(f"heal needs one joiner flag per worker ({w}) and a donor in [0, {w}) "
                     f"that is not a joiner; got {len(joiners)} flags, donor {donor}.")
  specs = program.state_specs()
  axes = config.batch_axes
  # Built from host data on each device (device_put would check equality across processes
  # with a collective over all devices, whose communicator may be broken).
  host = np.asarray(joiners, bool)
  flags = jax.make_array_from_callback(host.shape, NamedSharding(config.mesh, P(axes)),
                                       lambda index: host[index])

  def heal_local(state, flag):
    joining = flag[0]
    # Each device's own buffers (a joiner's replicated copies may hold anything), gathered in
    # mesh order; the donor's are taken.
    gathered, _ = comm.all_gather(state, axes)
    donor_state = jax.tree.map(lambda x: x[donor], gathered)
    params = jax.tree.map(lambda pw, mine, d: jnp.where(joining, d, mine) if pw else d,
                          layout.params, state.params, donor_state.params)
    # The donor's own parameters on this device (its worker row of per-worker leaves).
    fresh = config.optimizer.init(jax.tree.map(lambda pw, x: x[0] if pw else x,
                                                layout.params, donor_state.params))
    opt = jax.tree.map(
        lambda pw, mine, d, f: jnp.where(joining, f[None], mine) if pw else d,
        layout.opt_state, state.opt_state, donor_state.opt_state, fresh)
    return TrainState(step=donor_state.step, params=params, opt_state=opt)

  fn = jax.jit(jax.shard_map(heal_local, mesh=config.mesh, in_specs=(specs, P(axes)),
                             out_specs=specs))
  return fn(state, flags)


def gather(program: Program, state: TrainState) -> TrainState:
  """The whole state on every process, as numpy (per-worker leaves: all rows, mesh order).

  Collective over `program`'s mesh (every process calls it); what a checkpoint of the live
  islands is written from, by one process. Typed PRNG keys come as their key data.

  >>> import jax, jax.numpy as jnp, optax
  >>> from jaxcomm import local, train
  >>> p = train.make_program(lambda p, b: jnp.mean((b["x"] * p["w"]) ** 2),
  ...                        local.local_sgd(optax.sgd(0.1), 2),
  ...                        train.make_mesh({"data": 4}, devices=jax.devices()[:4]),
  ...                        {"w": jnp.ones(())})
  >>> s, _, _ = p.step(p.init({"w": jnp.ones(())}), {"x": jnp.arange(4.0)})
  >>> gather(p, s).params["w"].astype(np.float64).round(2).tolist()
  [1.0, 0.8, 0.2, -0.8]
  """
  specs = program.state_specs()
  layout, axes = program.layout, program.config.batch_axes

  def gather_local(state):
    def one(pw, x):
      return comm.all_gather(x, axes, tiled=True)[0] if pw else x
    return TrainState(step=state.step,
                      params=jax.tree.map(one, layout.params, state.params),
                      opt_state=jax.tree.map(one, layout.opt_state, state.opt_state))

  replicated = jax.tree.map(lambda _: P(), specs, is_leaf=lambda x: isinstance(x, P))
  fn = jax.jit(jax.shard_map(gather_local, mesh=program.config.mesh, in_specs=(specs,),
                             out_specs=replicated))

  def host(x):
    x = x.addressable_data(0)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)

  return jax.tree.map(host, fn(state))

