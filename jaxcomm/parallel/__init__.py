"""Layouts: meshes and axis rules, ZeRO 1/2/3, Megatron tensor and sequence parallelism."""

from jaxcomm.parallel._collective_matmul import matmul_allgather_overlapped
from jaxcomm.parallel._fsdp import fsdp
from jaxcomm.parallel._layout import Layout
from jaxcomm.parallel._mesh import AXES
from jaxcomm.parallel._mesh import BATCH_AXES
from jaxcomm.parallel._mesh import make_mesh
from jaxcomm.parallel._mesh import parse_mesh
from jaxcomm.parallel._rules import DEFAULT_RULES
from jaxcomm.parallel._rules import ReplicationWarning
from jaxcomm.parallel._rules import logical_to_spec
from jaxcomm.parallel._rules import make_rules
from jaxcomm.parallel._rules import param_specs
from jaxcomm.parallel._rules import replicated_fraction
from jaxcomm.parallel._rules import spec_axes
from jaxcomm.parallel._tensor import attention_tp
from jaxcomm.parallel._tensor import dense_column
from jaxcomm.parallel._tensor import dense_row
from jaxcomm.parallel._tensor import mlp_tp
from jaxcomm.parallel._zero import ZeroState
from jaxcomm.parallel._zero import zero

__all__ = (
    "AXES",
    "BATCH_AXES",
    "DEFAULT_RULES",
    "Layout",
    "ReplicationWarning",
    "ZeroState",
    "attention_tp",
    "dense_column",
    "dense_row",
    "fsdp",
    "logical_to_spec",
    "make_mesh",
    "make_rules",
    "matmul_allgather_overlapped",
    "mlp_tp",
    "param_specs",
    "parse_mesh",
    "replicated_fraction",
    "spec_axes",
    "zero",
)
