"""Every-step gradient synchronisation as optax transforms."""

from jaxcomm.sync._mean import MeanState
from jaxcomm.sync._mean import mean
from jaxcomm.sync._skip import SkipNonfiniteState
from jaxcomm.sync._skip import skip_nonfinite
from jaxcomm.sync._skip import skipped_steps

__all__ = (
    "MeanState",
    "SkipNonfiniteState",
    "mean",
    "skip_nonfinite",
    "skipped_steps",
)
