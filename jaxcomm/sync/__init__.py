"""Every-step gradient synchronisation as optax transforms."""

from jaxcomm.sync._mean import MeanState
from jaxcomm.sync._mean import mean

__all__ = (
    "MeanState",
    "mean",
)
