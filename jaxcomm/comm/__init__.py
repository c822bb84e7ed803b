"""How it travels: collectives with wire bytes, byte counters, and reading compiled HLO.

This is the only jaxcomm module that calls `jax.lax` collectives.
"""

from jaxcomm.comm._collectives import AxisName
from jaxcomm.comm._collectives import all_gather
from jaxcomm.comm._collectives import all_gather_bytes
from jaxcomm.comm._collectives import all_to_all
from jaxcomm.comm._collectives import all_to_all_bytes
from jaxcomm.comm._collectives import allreduce_bytes
from jaxcomm.comm._collectives import axis_size
from jaxcomm.comm._collectives import mean
from jaxcomm.comm._collectives import ppermute
from jaxcomm.comm._collectives import reduce_scatter
from jaxcomm.comm._collectives import reduce_scatter_bytes
from jaxcomm.comm._collectives import shift
from jaxcomm.comm._collectives import sum  # pylint: disable=redefined-builtin
from jaxcomm.comm._collectives import from_bits
from jaxcomm.comm._collectives import to_bits
from jaxcomm.comm._collectives import tree_bytes
from jaxcomm.comm._collectives import two_phase_sum
from jaxcomm.comm._collectives import varying
from jaxcomm.comm._collectives import varying_axes
from jaxcomm.comm._counter import add_bytes
from jaxcomm.comm._counter import counted_bytes
from jaxcomm.comm._counter import zero_bytes
from jaxcomm.comm._encoded import reduce_scatter_encoded
from jaxcomm.comm._inspect import Collective
from jaxcomm.comm._inspect import CollectiveReport
from jaxcomm.comm._inspect import compiled_text
from jaxcomm.comm._inspect import inspect
from jaxcomm.comm._inspect import parse_hlo

__all__ = (
    "AxisName",
    "Collective",
    "CollectiveReport",
    "add_bytes",
    "all_gather",
    "all_gather_bytes",
    "all_to_all",
    "all_to_all_bytes",
    "allreduce_bytes",
    "axis_size",
    "compiled_text",
    "from_bits",
    "counted_bytes",
    "inspect",
    "mean",
    "parse_hlo",
    "ppermute",
    "reduce_scatter",
    "reduce_scatter_bytes",
    "reduce_scatter_encoded",
    "shift",
    "sum",
    "to_bits",
    "tree_bytes",
    "two_phase_sum",
    "varying",
    "varying_axes",
    "zero_bytes",
)
