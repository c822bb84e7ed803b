"""How it travels: collectives with wire bytes, byte counters, reading compiled HLO, and the
latency-bandwidth cost of collectives on a network topology.

This is the only jaxcomm module that calls `jax.lax` collectives.
"""

from jaxcomm.comm._branch import cond
from jaxcomm.comm._branch import switch
from jaxcomm.comm._collectives import AxisName
from jaxcomm.comm._collectives import all_gather
from jaxcomm.comm._collectives import all_gather_bytes
from jaxcomm.comm._collectives import all_to_all
from jaxcomm.comm._collectives import all_to_all_bytes
from jaxcomm.comm._collectives import allreduce_bytes
from jaxcomm.comm._collectives import axis_names
from jaxcomm.comm._collectives import axis_size
from jaxcomm.comm._collectives import from_bits
from jaxcomm.comm._collectives import ppermute
from jaxcomm.comm._collectives import reduce_scatter
from jaxcomm.comm._collectives import is_numeric
from jaxcomm.comm._collectives import reduce_scatter_bytes
from jaxcomm.comm._collectives import require_varying
from jaxcomm.comm._collectives import shift
from jaxcomm.comm._collectives import to_bits
from jaxcomm.comm._collectives import tree_bytes
from jaxcomm.comm._collectives import varying
from jaxcomm.comm._collectives import varying_axes
from jaxcomm.comm._compressed import COLLECTIVES
from jaxcomm.comm._compressed import all_gather_encoded
from jaxcomm.comm._compressed import CompressedSum
from jaxcomm.comm._compressed import ScatteredSum
from jaxcomm.comm._compressed import compressed_bytes
from jaxcomm.comm._compressed import compressed_sum
from jaxcomm.comm._compressed import gather_sum
from jaxcomm.comm._compressed import linear_sum
from jaxcomm.comm._compressed import reduce_scatter_encoded
from jaxcomm.comm._compressed import two_phase
from jaxcomm.comm._sum import mean
from jaxcomm.comm._sum import sum
from jaxcomm.comm._sum import two_phase_sum
from jaxcomm.comm._cost import ALGORITHMS
from jaxcomm.comm._cost import CollectiveCost
from jaxcomm.comm._cost import CommCost
from jaxcomm.comm._cost import Link
from jaxcomm.comm._cost import OPS
from jaxcomm.comm._cost import PER
from jaxcomm.comm._cost import PRESETS
from jaxcomm.comm._cost import Topology
from jaxcomm.comm._cost import algorithm_times
from jaxcomm.comm._cost import collective_time
from jaxcomm.comm._cost import cost
from jaxcomm.comm._cost import preset
from jaxcomm.comm._cost import topology
from jaxcomm.comm._cost import wire_bytes_time
from jaxcomm.comm._counter import add_bytes
from jaxcomm.comm._counter import counted_bytes
from jaxcomm.comm._counter import zero_bytes
from jaxcomm.comm._inspect import Collective
from jaxcomm.comm._inspect import CollectiveReport
from jaxcomm.comm._inspect import compiled_text
from jaxcomm.comm._inspect import inspect
from jaxcomm.comm._inspect import parse_hlo
from jaxcomm.comm._sites import Sites

__all__ = (
    "ALGORITHMS",
    "AxisName",
    "COLLECTIVES",
    "Collective",
    "CollectiveCost",
    "CollectiveReport",
    "CommCost",
    "CompressedSum",
    "is_numeric",
    "ScatteredSum",
    "Sites",
    "Link",
    "OPS",
    "PER",
    "PRESETS",
    "Topology",
    "add_bytes",
    "algorithm_times",
    "all_gather",
    "all_gather_bytes",
    "all_gather_encoded",
    "all_to_all",
    "all_to_all_bytes",
    "allreduce_bytes",
    "axis_names",
    "axis_size",
    "collective_time",
    "compiled_text",
    "compressed_bytes",
    "compressed_sum",
    "cond",
    "cost",
    "counted_bytes",
    "from_bits",
    "gather_sum",
    "inspect",
    "linear_sum",
    "mean",
    "parse_hlo",
    "ppermute",
    "preset",
    "reduce_scatter",
    "reduce_scatter_bytes",
    "reduce_scatter_encoded",
    "require_varying",
    "shift",
    "sum",
    "switch",
    "to_bits",
    "topology",
    "tree_bytes",
    "two_phase",
    "two_phase_sum",
    "varying",
    "varying_axes",
    "wire_bytes_time",
    "zero_bytes",
)
