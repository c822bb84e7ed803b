"""Train state, the shard_map step builder (linen parameter trees or NNX models), the training
loop, checkpoints, multi-host start."""

from jaxcomm.train._checkpoint import Checkpointer
from jaxcomm.train._distributed import multi_process_environment
from jaxcomm.train._distributed import start_distributed
from jaxcomm.train._loop import fit
from jaxcomm.train._nnx import step_key
from jaxcomm.train._step import StateLayout
from jaxcomm.train._step import TrainState
from jaxcomm.train._step import Trainer
from jaxcomm.train._trials import fold_in_trials
from jaxcomm.parallel import make_mesh  # the one mesh builder, re-exported

__all__ = (
    "Checkpointer",
    "StateLayout",
    "TrainState",
    "Trainer",
    "fit",
    "fold_in_trials",
    "make_mesh",
    "multi_process_environment",
    "start_distributed",
    "step_key",
)
