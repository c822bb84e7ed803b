"""When it travels: schedules that wrap an inner optimiser (local updates, overlap, staleness)."""

from jaxcomm.local._acco import AccoState
from jaxcomm.local._acco import acco
from jaxcomm.local._acco import micro_batch_loss
from jaxcomm.local._delayed import DelayedState
from jaxcomm.local._delayed import delayed
from jaxcomm.local._stale import StaleState
from jaxcomm.local._stale import delay_compensation
from jaxcomm.local._stale import stale

__all__ = (
    "AccoState",
    "DelayedState",
    "StaleState",
    "acco",
    "delay_compensation",
    "delayed",
    "micro_batch_loss",
    "stale",
)
