"""MuLoCo: DiLoCo whose inner optimiser is Muon, with quantised outer gradients."""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxcomm import _validate as v
from jaxcomm import codecs, comm, sync
from jaxcomm.local import _core
from jaxcomm.local import _diloco


def muloco(learning_rate: optax.ScalarOrSchedule, sync_every: int = 30,
           axis_name: comm.AxisName = "replica", *, param_specs: Any = None,
           strategy: str = "owner", weight_decay: float = 0.0,
           outer: optax.GradientTransformation | None = None, bits: int | None = None,
           block: int = 256, memory: str | sync.ErrorMemory | None = None,
           collective: str | None = None, participation: _core.Participation = None,
           key: jax.Array | None = None) -> optax.GradientTransformationExtraArgs:
  """MuLoCo: DiLoCo (`local.diloco`) with `sync.muon` as each worker's inner optimiser.

  Each worker (replica) takes H inner Muon steps on its own gradient (no communication over
  `axis_name`; inside the replica the matrices are orthogonalised over their inner axes by
  `strategy`, see `sync.muon`), then the outer gradient Δ = θ_out − mean_w θ_w travels
  quantised to `bits` (symmetric uniform levels, a float32 scale per `block` elements) with
  optional error feedback, and the outer optimiser (Nesterov SGD) steps θ_out. K = 1 worker
  with H = 1 and outer SGD(1.0) is one-worker Muon.

  Bytes per sync over `axis_name` (W workers, n elements of this device's shards): float32:
  an all-reduce of 4n; with `bits`: the payload P = ceil(n bits / 8) + 4 ceil(n / block)
  travels by gather ((W-1) P) or `collective="two_phase"` (2 (W-1)/W P, chunks re-encoded).

  Args:
    learning_rate: Muon's (inner) learning rate.
    sync_every: H >= 1, inner steps between outer steps (the paper: 30).
    axis_name: the mesh axis (or tuple) of the workers; None for one device.
    param_specs: the parameters' PartitionSpecs when they are sharded inside a replica.
    strategy: how Muon reaches whole matrices: "owner" or "gram" (`sync.muon`).
    weight_decay: Muon's decoupled weight decay.
    outer: the outer optimiser; None: Nesterov SGD, learning rate 0.7, momentum 0.9.
    bits: None (float32 outer gradient) or the code width 2..16 (the paper: 4, or 2 with
      error feedback).
    block: elements per float32 scale of the quantised outer gradient.
    memory: the error memory of the quantised outer gradient (needs `bits`): as in
      `local.diloco` (None, "ef", "loco" or a `sync.ErrorMemory`).
    collective: how quantised payloads travel (`local.diloco`): None, "gather" or
      "two_phase".
    participation: live-worker mask per sync (`local.diloco`).
    key: PRNG key of the codec (unused by the deterministic quantiser).

  Returns:
    An `optax.GradientTransformationExtraArgs` (a `local.diloco` state) that needs `params`.

  References:
    Thérien et al., MuLoCo: Muon is a practical inner optimizer for DiLoCo, arXiv 2505.23725;
    Douillard et al., DiLoCo, arXiv 2311.08105.

  >>> import jax.numpy as jnp, optax
  >>> tx = muloco(0.1, sync_every=1, axis_name=None, outer=optax.sgd(1.0))
  >>> params = {"w": jnp.eye(2)}
  >>> updates, state = tx.update({"w": jnp.ones((2, 2))}, tx.init(params), params)
  >>> state.outer_params["w"].shape
  (2, 2)
  """
  if bits is not None:
    bits = v.integer("bits", bits, low=2, high=16)
  block = v.integer("block", block, low=1)
  if memory is not None and bits is None:
    raise ValueError(f"memory={memory!r} needs bits (error feedback of a quantised outer "
                     "gradient); with bits=None the outer gradient travels exactly.")
  inner = sync.muon(learning_rate, strategy=strategy, axis_name=None, param_specs=param_specs,
                    weight_decay=weight_decay)
  if outer is None:
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  codec = None if bits is None else codecs.uniform(bits, block=block)
  return _diloco.diloco(inner, outer, sync_every, axis_name, codec=codec, memory=memory,
                        collective=collective, participation=participation, key=key)
