"""Layouts: meshes and axis rules, ZeRO 1/2/3, Megatron tensor and sequence parallelism,
sequence-parallel attention (ring, Ulysses, linear) and pipeline schedules."""

from jaxcomm.parallel._by_sharding import by_sharding
from jaxcomm.parallel._by_sharding import sharding_label
from jaxcomm.parallel._collective_matmul import matmul_allgather_overlapped
from jaxcomm.parallel._fsdp import fsdp
from jaxcomm.parallel._layout import Layout
from jaxcomm.parallel._linear_attention import linear_attention
from jaxcomm.parallel._linear_attention import linear_attention_allscan
from jaxcomm.parallel._linear_attention import linear_attention_allscan_bytes
from jaxcomm.parallel._linear_attention import linear_attention_lasp2
from jaxcomm.parallel._linear_attention import linear_attention_lasp2_bytes
from jaxcomm.parallel._linear_attention import linear_attention_lasp_ring
from jaxcomm.parallel._attention import causal_attention
from jaxcomm.parallel._mesh import AXES
from jaxcomm.parallel._mesh import BATCH_AXES
from jaxcomm.parallel._mesh import make_mesh
from jaxcomm.parallel._mesh import parse_mesh
from jaxcomm.parallel._pipeline import BACKWARD
from jaxcomm.parallel._pipeline import FORWARD
from jaxcomm.parallel._pipeline import IDLE
from jaxcomm.parallel._pipeline import PipelineSchedule
from jaxcomm.parallel._pipeline import bubble_fraction_gpipe
from jaxcomm.parallel._pipeline import pipeline_bytes
from jaxcomm.parallel._pipeline import pipeline_loss
from jaxcomm.parallel._pipeline import pipeline_run
from jaxcomm.parallel._pipeline import schedule_1f1b
from jaxcomm.parallel._pipeline import schedule_gpipe
from jaxcomm.parallel._ring_attention import attention_ring
from jaxcomm.parallel._ring_attention import attention_ring_bytes
from jaxcomm.parallel._ring_attention import zigzag_order
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
from jaxcomm.parallel._ulysses import attention_ulysses
from jaxcomm.parallel._ulysses import attention_ulysses_bytes
from jaxcomm.parallel._zero import ZeroState
from jaxcomm.parallel._zero import zero

__all__ = (
    "AXES",
    "BACKWARD",
    "BATCH_AXES",
    "DEFAULT_RULES",
    "FORWARD",
    "IDLE",
    "Layout",
    "PipelineSchedule",
    "ReplicationWarning",
    "ZeroState",
    "attention_ring",
    "attention_ring_bytes",
    "attention_tp",
    "attention_ulysses",
    "attention_ulysses_bytes",
    "bubble_fraction_gpipe",
    "by_sharding",
    "causal_attention",
    "dense_column",
    "dense_row",
    "fsdp",
    "linear_attention",
    "linear_attention_allscan",
    "linear_attention_allscan_bytes",
    "linear_attention_lasp2",
    "linear_attention_lasp2_bytes",
    "linear_attention_lasp_ring",
    "logical_to_spec",
    "make_mesh",
    "make_rules",
    "matmul_allgather_overlapped",
    "mlp_tp",
    "param_specs",
    "parse_mesh",
    "pipeline_bytes",
    "pipeline_loss",
    "pipeline_run",
    "replicated_fraction",
    "schedule_1f1b",
    "schedule_gpipe",
    "sharding_label",
    "spec_axes",
    "zero",
    "zigzag_order",
)
