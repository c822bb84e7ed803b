"""Elastic training: islands (processes) die and (re)join while training goes on.

Built on JAX's own fault tolerance (`jax_enable_recoverability` and
`jax.experimental.multihost_utils.live_devices`), with JAX's coordination service in a
process that does no training (`python -m jaxcomm.elastic.coordinator`), so any worker,
the first one too, may die: `start_distributed` joins such a run, `fit` trains in rounds
over the live islands (a round that a death or a hang interrupts is discarded on every
survivor and redone without the lost island; a process that restarts is healed from a live
peer at the next round boundary), `remesh` and `heal` are the two state moves underneath,
`Membership` the agreement on who is live (led by the lowest live process holding the
state) and `Quorum` the rules for when the live processes may train on.
"""

from jaxcomm.elastic._record import Event
from jaxcomm.elastic._record import Result
from jaxcomm.elastic._loop import digest
from jaxcomm.elastic._loop import fit
from jaxcomm.elastic._watchdog import EVICTED
from jaxcomm.elastic._membership import Evicted
from jaxcomm.elastic._membership import Generation
from jaxcomm.elastic._membership import Membership
from jaxcomm.elastic._membership import RoundAborted
from jaxcomm.elastic._membership import candidate_orders
from jaxcomm.elastic._quorum import Quorum
from jaxcomm.elastic._quorum import QuorumLost
from jaxcomm.elastic._start import start_distributed
from jaxcomm.elastic._state import gather
from jaxcomm.elastic._state import heal
from jaxcomm.elastic._state import remesh

__all__ = (
    "EVICTED",
    "Event",
    "Evicted",
    "Generation",
    "Membership",
    "Quorum",
    "QuorumLost",
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
