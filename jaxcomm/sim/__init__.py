"""Simulated time: heterogeneous workers, stragglers and pipeline staleness."""

from jaxcomm.sim._async import METHODS
from jaxcomm.sim._async import Method
from jaxcomm.sim._async import SimResult
from jaxcomm.sim._async import asynchronous_sgd
from jaxcomm.sim._async import mindflayer_sgd
from jaxcomm.sim._async import rennala_sgd
from jaxcomm.sim._async import simulate
from jaxcomm.sim._async import synchronous_sgd
from jaxcomm.sim._pipemare import PipeMareResult
from jaxcomm.sim._pipemare import PipeMareState
from jaxcomm.sim._pipemare import pipeline_delays
from jaxcomm.sim._pipemare import pipemare_sgd
from jaxcomm.sim._workers import ComputeModel
from jaxcomm.sim._workers import fixed
from jaxcomm.sim._workers import heavy_tailed
from jaxcomm.sim._workers import lognormal

__all__ = (
    "METHODS",
    "ComputeModel",
    "Method",
    "PipeMareResult",
    "PipeMareState",
    "SimResult",
    "asynchronous_sgd",
    "fixed",
    "heavy_tailed",
    "lognormal",
    "mindflayer_sgd",
    "pipeline_delays",
    "pipemare_sgd",
    "rennala_sgd",
    "simulate",
    "synchronous_sgd",
)
