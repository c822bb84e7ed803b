"""Every-step gradient synchronisation as optax transforms."""

from jaxcomm.sync._compressed import CompressedState
from jaxcomm.sync._compressed import compressed
from jaxcomm.sync._demo import DemoState
from jaxcomm.sync._demo import demo
from jaxcomm.sync._demo import demo_bytes
from jaxcomm.sync._dion import DionState
from jaxcomm.sync._dion import dion
from jaxcomm.sync._dion2 import Dion2State
from jaxcomm.sync._dion2 import dion2
from jaxcomm.sync._gossip import ChocoState
from jaxcomm.sync._gossip import DpsgdState
from jaxcomm.sync._gossip import choco
from jaxcomm.sync._gossip import consensus_distance
from jaxcomm.sync._gossip import dpsgd
from jaxcomm.sync._gossip import gossip
from jaxcomm.sync._gossip import stacked_consensus_distance
from jaxcomm.sync._gradient_coding import FractionalRepetition
from jaxcomm.sync._gradient_coding import GradientCodingState
from jaxcomm.sync._gradient_coding import decode_gradient
from jaxcomm.sync._gradient_coding import fractional_repetition
from jaxcomm.sync._gradient_coding import gradient_coding
from jaxcomm.sync._lq_sgd import lq_sgd
from jaxcomm.sync._lq_sgd import lq_sgd_bytes
from jaxcomm.sync._mean import MeanState
from jaxcomm.sync._mean import mean
from jaxcomm.sync._memory import ErrorMemory
from jaxcomm.sync._memory import ef21
from jaxcomm.sync._memory import error_feedback
from jaxcomm.sync._memory import loco
from jaxcomm.sync._memory import resolve_memory
from jaxcomm.sync._muon import MuonState
from jaxcomm.sync._muon import muon
from jaxcomm.sync._muonbp import muonbp
from jaxcomm.sync._onebit_adam import OnebitAdamState
from jaxcomm.sync._onebit_adam import onebit_adam
from jaxcomm.sync._onebit_adam import onebit_adam_bytes
from jaxcomm.sync._powersgd import PowerSGDState
from jaxcomm.sync._powersgd import powersgd
from jaxcomm.sync._powersgd import powersgd_bytes
from jaxcomm.sync._skip import SkipNonfiniteState
from jaxcomm.sync._skip import skip_nonfinite
from jaxcomm.sync._skip import skipped_steps
from jaxcomm.sync._topology import GRAPHS
from jaxcomm.sync._topology import GossipGraph
from jaxcomm.sync._topology import gossip_graph
from jaxcomm.sync._topology import random_matchings

__all__ = (
    "ChocoState",
    "CompressedState",
    "DemoState",
    "Dion2State",
    "DionState",
    "DpsgdState",
    "ErrorMemory",
    "FractionalRepetition",
    "GRAPHS",
    "GossipGraph",
    "GradientCodingState",
    "MeanState",
    "MuonState",
    "OnebitAdamState",
    "PowerSGDState",
    "SkipNonfiniteState",
    "choco",
    "compressed",
    "consensus_distance",
    "decode_gradient",
    "demo",
    "demo_bytes",
    "dion",
    "dion2",
    "dpsgd",
    "ef21",
    "error_feedback",
    "fractional_repetition",
    "gossip",
    "gossip_graph",
    "gradient_coding",
    "loco",
    "lq_sgd",
    "lq_sgd_bytes",
    "mean",
    "muon",
    "muonbp",
    "onebit_adam",
    "onebit_adam_bytes",
    "powersgd",
    "powersgd_bytes",
    "random_matchings",
    "resolve_memory",
    "skip_nonfinite",
    "skipped_steps",
    "stacked_consensus_distance",
)
