"""Every-step gradient synchronisation as optax transforms."""

from jaxcomm.sync._compressed import CompressedState
from jaxcomm.sync._compressed import compressed
from jaxcomm.sync._mean import MeanState
from jaxcomm.sync._mean import mean

__all__ = (
    "CompressedState",
    "MeanState",
    "compressed",
    "mean",
)
