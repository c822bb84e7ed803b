"""Every-step gradient synchronisation as optax transforms."""

from jaxcomm.sync._gossip import ChocoState
from jaxcomm.sync._gossip import DpsgdState
from jaxcomm.sync._gossip import choco
from jaxcomm.sync._gossip import consensus_distance
from jaxcomm.sync._gossip import dpsgd
from jaxcomm.sync._gossip import gossip
from jaxcomm.sync._gossip import stacked_consensus_distance
from jaxcomm.sync._mean import MeanState
from jaxcomm.sync._mean import mean
from jaxcomm.sync._topology import GRAPHS
from jaxcomm.sync._topology import GossipGraph
from jaxcomm.sync._topology import gossip_graph

__all__ = (
    "ChocoState",
    "DpsgdState",
    "GRAPHS",
    "GossipGraph",
    "MeanState",
    "choco",
    "consensus_distance",
    "dpsgd",
    "gossip",
    "gossip_graph",
    "mean",
    "stacked_consensus_distance",
)
