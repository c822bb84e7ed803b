"""Elastic training: islands (processes) die and (re)join while training goes on.

Built on JAX's own fault tolerance (`jax_enable_recoverability` and
`jax.experimental.multihost_utils.live_devices`): `start_distributed` starts a run whose
processes do not share fate, `fit` trains in rounds over the live islands (a round that a
death interrupts is discarded on every survivor and redone without the dead island; a
process that restarts is healed from a live peer at the next round boundary), `remesh` and
`heal` are the two state moves underneath, and `Membership` the agreement on who is live.
"""

from jaxcomm.elastic._loop import Event
from jaxcomm.elastic._loop import Result
from jaxcomm.elastic._loop import digest
from jaxcomm.elastic._loop import fit
from jaxcomm.elastic._membership import Generation
from jaxcomm.elastic._membership import Membership
from jaxcomm.elastic._membership import RoundAborted
from jaxcomm.elastic._membership import candidate_orders
from jaxcomm.elastic._start import start_distributed
from jaxcomm.elastic._state import gather
from jaxcomm.elastic._state import heal
from jaxcomm.elastic._state import remesh

__all__ = (
    "Event",
    "Generation",
    "Membership",
    "Result",
    "RoundAborted",
    "candidate_orders",
    "digest",
    "fit",
    "gather",
    "heal",
    "remesh",
    "start_distributed",
)
