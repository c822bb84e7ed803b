"""Simulated wall clock: measured or modelled compute plus exposed communication on a
network topology (`jaxcomm.comm.cost`), and time to a target loss from recorded runs."""

from jaxcomm.sim._clock import OVERLAP_STEPS
from jaxcomm.sim._clock import Timeline
from jaxcomm.sim._clock import comm_seconds_per_step
from jaxcomm.sim._clock import overlap_steps
from jaxcomm.sim._clock import simulate
from jaxcomm.sim._compute import measure_seconds
from jaxcomm.sim._compute import seconds_from_flops
from jaxcomm.sim._compute import step_flops
from jaxcomm.sim._target import smooth
from jaxcomm.sim._target import time_to_target

__all__ = (
    "OVERLAP_STEPS",
    "Timeline",
    "comm_seconds_per_step",
    "measure_seconds",
    "overlap_steps",
    "seconds_from_flops",
    "simulate",
    "smooth",
    "step_flops",
    "time_to_target",
)
