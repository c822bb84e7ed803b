"""Train state, the shard_map step builder, and the training loop."""

from jaxcomm.train._loop import fit
from jaxcomm.train._step import StateLayout
from jaxcomm.train._step import TrainState
from jaxcomm.train._step import Trainer
from jaxcomm.train._step import make_mesh

__all__ = (
    "StateLayout",
    "TrainState",
    "Trainer",
    "fit",
    "make_mesh",
)
