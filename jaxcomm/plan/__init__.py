"""Planning real model sizes without allocating them: a method's step compiled for
`jax.ShapeDtypeStruct` parameters, its exact wire bytes per mesh axis (`comm.inspect` of the
compiled program, and the transform's own counters at each step), its memory and FLOPs per
device (XLA's analyses), and its predicted step time on a network (`comm.cost`, `sim`).

    step = plan.compile_step(trainer, abstract_params, abstract_batch)
    seconds = plan.compute_seconds(step.flops, plan.device("h100"), mfu=0.4)
    plan.predict(step, {"data": "wan"}, seconds, overlap_steps=0).step

A model that is a stack of identical blocks is planned at 1 and 2 blocks and extrapolated
(`plan_stack`); plans are kept on disk by what they depend on (`PlanCache`, `plan_key`).

`python -m experiments.plan` plans every method of a model preset on a mesh and links.
"""

from jaxcomm.plan._blocks import NotAffine
from jaxcomm.plan._blocks import extrapolate
from jaxcomm.plan._blocks import plan_stack
from jaxcomm.plan._cache import PlanCache
from jaxcomm.plan._cache import plan_key
from jaxcomm.plan._compile import Memory
from jaxcomm.plan._compile import StepPlan
from jaxcomm.plan._compile import abstract_batch
from jaxcomm.plan._compile import abstract_state
from jaxcomm.plan._compile import compile_step
from jaxcomm.plan._devices import DEVICES
from jaxcomm.plan._devices import Device
from jaxcomm.plan._devices import check_mfu
from jaxcomm.plan._devices import compute_seconds
from jaxcomm.plan._devices import device
from jaxcomm.plan._predict import Prediction
from jaxcomm.plan._predict import crossover
from jaxcomm.plan._predict import predict
from jaxcomm.plan._schedule import counted_bytes
from jaxcomm.plan._schedule import unwrap

__all__ = (
    "DEVICES",
    "Device",
    "Memory",
    "NotAffine",
    "PlanCache",
    "Prediction",
    "StepPlan",
    "abstract_batch",
    "abstract_state",
    "check_mfu",
    "compile_step",
    "compute_seconds",
    "counted_bytes",
    "crossover",
    "device",
    "extrapolate",
    "plan_key",
    "plan_stack",
    "predict",
    "unwrap",
)
