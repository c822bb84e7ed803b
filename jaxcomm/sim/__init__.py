"""Simulated time: the wall clock of a run (measured or modelled compute plus exposed
communication on a network topology, `jaxcomm.comm.cost`), time to a target loss from
recorded runs, heterogeneous workers, stragglers and pipeline staleness, and failures: a
failure model on the clock and each method's goodput under it."""

from jaxcomm.sim._async import METHODS
from jaxcomm.sim._async import Method
from jaxcomm.sim._async import SimResult
from jaxcomm.sim._async import asynchronous_sgd
from jaxcomm.sim._async import mindflayer_sgd
from jaxcomm.sim._async import rennala_sgd
from jaxcomm.sim._async import simulate_workers
from jaxcomm.sim._async import synchronous_sgd
from jaxcomm.sim._clock import Timeline
from jaxcomm.sim._clock import comm_seconds_per_step
from jaxcomm.sim._clock import simulate
from jaxcomm.sim._compute import measure_seconds
from jaxcomm.sim._decoupled import decoupled_schedule
from jaxcomm.sim._failures import FAILURE_PRESETS
from jaxcomm.sim._failures import FailureModel
from jaxcomm.sim._failures import checkpoint_goodput
from jaxcomm.sim._failures import draw_failures
from jaxcomm.sim._failures import expected_slowdown
from jaxcomm.sim._failures import failure_model
from jaxcomm.sim._failures import first_order_goodput
from jaxcomm.sim._failures import step_slowdowns
from jaxcomm.sim._failures import young_interval
from jaxcomm.sim._goodput import FailureRun
from jaxcomm.sim._goodput import Semantics
from jaxcomm.sim._goodput import expected_goodput
from jaxcomm.sim._goodput import simulate_failures
from jaxcomm.sim._compute import seconds_from_flops
from jaxcomm.sim._compute import step_flops
from jaxcomm.sim._overlap import BackwardOverlap
from jaxcomm.sim._overlap import backward_overlap
from jaxcomm.sim._pipemare import PipeMareResult
from jaxcomm.sim._pipemare import PipeMareState
from jaxcomm.sim._pipemare import pipeline_delays
from jaxcomm.sim._pipemare import pipemare_sgd
from jaxcomm.sim._rounds import round_seconds
from jaxcomm.sim._target import smooth
from jaxcomm.sim._target import steps_within
from jaxcomm.sim._target import time_to_target
from jaxcomm.sim._workers import ComputeModel
from jaxcomm.sim._workers import fixed
from jaxcomm.sim._workers import heavy_tailed
from jaxcomm.sim._workers import lognormal

__all__ = (
    "BackwardOverlap",
    "ComputeModel",
    "FAILURE_PRESETS",
    "FailureModel",
    "FailureRun",
    "METHODS",
    "Method",
    "PipeMareResult",
    "PipeMareState",
    "Semantics",
    "SimResult",
    "Timeline",
    "asynchronous_sgd",
    "backward_overlap",
    "checkpoint_goodput",
    "comm_seconds_per_step",
    "decoupled_schedule",
    "draw_failures",
    "expected_goodput",
    "expected_slowdown",
    "failure_model",
    "first_order_goodput",
    "fixed",
    "heavy_tailed",
    "lognormal",
    "measure_seconds",
    "mindflayer_sgd",
    "pipeline_delays",
    "pipemare_sgd",
    "rennala_sgd",
    "round_seconds",
    "seconds_from_flops",
    "simulate",
    "simulate_failures",
    "simulate_workers",
    "smooth",
    "step_flops",
    "step_slowdowns",
    "steps_within",
    "synchronous_sgd",
    "time_to_target",
    "young_interval",
)
