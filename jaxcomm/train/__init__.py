"""Train state, the shard_map step builder (linen parameter trees or NNX models), the
`Program` record that loops, checkpoints, elastic runs and the planner take, the `Trainer`
convenience over it, the training loop, checkpoints, multi-host start."""

from jaxcomm.train._checkpoint import Checkpointer
from jaxcomm.train._distributed import multi_process_environment
from jaxcomm.train._distributed import start_distributed
from jaxcomm.train._loop import fit
from jaxcomm.train._nnx import step_key
from jaxcomm.train._program import Program
from jaxcomm.train._program import make_program
from jaxcomm.train._layout import StateLayout
from jaxcomm.train._layout import StepConfig
from jaxcomm.train._layout import derive_layout
from jaxcomm.train._step import TrainState
from jaxcomm.train._step import make_init
from jaxcomm.train._step import make_step
from jaxcomm.train._trainer import Trainer
from jaxcomm.train._trials import fold_in_trials
from jaxcomm.parallel import make_mesh  # the one mesh builder, re-exported

__all__ = (
    "Checkpointer",
    "Program",
    "StateLayout",
    "StepConfig",
    "TrainState",
    "Trainer",
    "derive_layout",
    "fit",
    "fold_in_trials",
    "make_init",
    "make_mesh",
    "make_program",
    "make_step",
    "multi_process_environment",
    "start_distributed",
    "step_key",
)
