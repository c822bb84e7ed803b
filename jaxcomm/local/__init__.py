"""When it travels: schedules that wrap an inner optimiser (local updates, overlap, staleness).

A local-update schedule (local SGD, DiLoCo, ...) is an optax transform that takes the worker's
local gradient, steps its inner optimiser, and on a sync step returns the updates that move
each worker to the synchronised parameters. Worker parameters therefore differ between
syncs, and the Trainer keeps them per worker. Bytes are counted inside the branch that syncs.
Every local-update schedule accepts a participation mask (which workers are live at each
sync).

`periodic(inner, sync_every, sync_fn, ...)` is the skeleton local SGD, DiLoCo, SCAFFOLD,
NoLoCo, DreamDDP, Streaming DiLoCo, CoCoDC and the hierarchical schedule are written on: it
owns the count, the inner step, idle workers, participation, the conditional sync and the byte
counter, and a method supplies its sync rule and its state (`help(periodic)`: the contract;
`SyncInfo`, `masked_average`, `masked_sum` and `worker_index` are what a sync rule works
with).
"""

from jaxcomm.local._acco import AccoState
from jaxcomm.local._acco import acco
from jaxcomm.local._acco import micro_batch_loss
from jaxcomm.local._cocodc import cocodc
from jaxcomm.local._core import masked_average
from jaxcomm.local._core import masked_sum
from jaxcomm.local._core import worker_index
from jaxcomm.local._decoupled import DecoupledDilocoState
from jaxcomm.local._decoupled import DecoupledSchedule
from jaxcomm.local._decoupled import decoupled_diloco
from jaxcomm.local._delayed import DelayedState
from jaxcomm.local._delayed import delayed
from jaxcomm.local._des_loc import DesLocState
from jaxcomm.local._des_loc import des_loc
from jaxcomm.local._diloco import DilocoState
from jaxcomm.local._diloco import diloco
from jaxcomm.local._dreamddp import DreamddpState
from jaxcomm.local._dreamddp import dreamddp
from jaxcomm.local._dreamddp import layer_groups
from jaxcomm.local._gossip_diloco import GossipDilocoState
from jaxcomm.local._gossip_diloco import factored_gossip_diloco
from jaxcomm.local._gossip_diloco import gasloc
from jaxcomm.local._hierarchical import HierarchicalState
from jaxcomm.local._hierarchical import hierarchical
from jaxcomm.local._local_sgd import LocalSgdState
from jaxcomm.local._local_sgd import local_sgd
from jaxcomm.local._muloco import muloco
from jaxcomm.local._noloco import NolocoState
from jaxcomm.local._noloco import noloco
from jaxcomm.local._periodic import PeriodicState
from jaxcomm.local._periodic import SyncInfo
from jaxcomm.local._periodic import periodic
from jaxcomm.local._pier import pier
from jaxcomm.local._pier import pier_momentum
from jaxcomm.local._scaffold import ScaffoldState
from jaxcomm.local._scaffold import scaffold
from jaxcomm.local._sparseloco import sparseloco
from jaxcomm.local._sparseloco import topk_chunks
from jaxcomm.local._stale import StaleState
from jaxcomm.local._stale import delay_compensation
from jaxcomm.local._stale import stale
from jaxcomm.local._fragments import StreamingDilocoState
from jaxcomm.local._streaming import streaming_diloco

__all__ = (
    "AccoState",
    "DecoupledDilocoState",
    "DecoupledSchedule",
    "DelayedState",
    "DesLocState",
    "DilocoState",
    "DreamddpState",
    "GossipDilocoState",
    "HierarchicalState",
    "LocalSgdState",
    "NolocoState",
    "PeriodicState",
    "ScaffoldState",
    "StaleState",
    "StreamingDilocoState",
    "SyncInfo",
    "acco",
    "cocodc",
    "decoupled_diloco",
    "delay_compensation",
    "delayed",
    "des_loc",
    "diloco",
    "dreamddp",
    "factored_gossip_diloco",
    "gasloc",
    "hierarchical",
    "layer_groups",
    "local_sgd",
    "masked_average",
    "masked_sum",
    "muloco",
    "micro_batch_loss",
    "noloco",
    "periodic",
    "pier",
    "pier_momentum",
    "scaffold",
    "sparseloco",
    "stale",
    "streaming_diloco",
    "topk_chunks",
    "worker_index",
)
