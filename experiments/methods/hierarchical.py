"""DASO-style hierarchy (`local.hierarchical`): exact all-reduce on the fast axis every step,
local SGD across the slow axis. The mesh names both axes, e.g. config.mesh = "slow=2,fast=4"
(the settings `slow_axis` / `fast_axis` say which is which). Over replicas of a sharded
model (config.mesh = "replica=2,fsdp=2,tensor=2") `slow_axis="replica"` and `fast_axis=None`:
the exact reduction inside a replica is the layout's (ZeRO-3 over fsdp)."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.hierarchical, skip=("inner",),
                             types={"participation": str, "worker_steps": tuple},
                             sync_every=10)


def build(settings, ctx):
  missing = [a for a in (settings.slow_axis, settings.fast_axis)
             if a not in ctx.mesh_shape and not (a is None and a is settings.fast_axis)]
  if missing:
    raise ValueError(f"slow_axis / fast_axis {missing} are not axes of the mesh "
                     f"{ctx.mesh_shape}; e.g. config.mesh = 'slow=2,fast=4'.")
  slow = ctx.mesh_shape[settings.slow_axis]
  return toolkit.call(local.hierarchical, settings, inner=ctx.inner,
                     participation=ctx.participation(settings.participation,
                                                     num_workers=slow))


def period(settings) -> int:
  """The slow axis syncs every `sync_every` steps (the fast axis every step)."""
  return settings.sync_every


failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed
