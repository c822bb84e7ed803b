"""Every-step gradient synchronisation as optax transforms."""

from jaxcomm.sync._compressed import CompressedState
from jaxcomm.sync._compressed import compressed
from jaxcomm.sync._demo import DemoState
from jaxcomm.sync._demo import demo
from jaxcomm.sync._demo import demo_bytes
from jaxcomm.sync._lq_sgd import lq_sgd
from jaxcomm.sync._lq_sgd import lq_sgd_bytes
from jaxcomm.sync._mean import MeanState
from jaxcomm.sync._mean import mean
from jaxcomm.sync._onebit_adam import OnebitAdamState
from jaxcomm.sync._onebit_adam import onebit_adam
from jaxcomm.sync._onebit_adam import onebit_adam_bytes
from jaxcomm.sync._powersgd import PowerSGDState
from jaxcomm.sync._powersgd import powersgd
from jaxcomm.sync._powersgd import powersgd_bytes

__all__ = (
    "CompressedState",
    "DemoState",
    "MeanState",
    "OnebitAdamState",
    "PowerSGDState",
    "compressed",
    "demo",
    "demo_bytes",
    "lq_sgd",
    "lq_sgd_bytes",
    "mean",
    "onebit_adam",
    "onebit_adam_bytes",
    "powersgd",
    "powersgd_bytes",
)
