"""Layouts: sequence parallel attention (softmax and linear) and pipeline schedules."""

from jaxcomm.parallel._linear_attention import linear_attention
from jaxcomm.parallel._linear_attention import linear_attention_allscan
from jaxcomm.parallel._linear_attention import linear_attention_allscan_bytes
from jaxcomm.parallel._linear_attention import linear_attention_lasp2
from jaxcomm.parallel._linear_attention import linear_attention_lasp2_bytes
from jaxcomm.parallel._linear_attention import linear_attention_lasp_ring
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
from jaxcomm.parallel._ulysses import attention_ulysses
from jaxcomm.parallel._ulysses import attention_ulysses_bytes

__all__ = (
    "BACKWARD",
    "FORWARD",
    "IDLE",
    "PipelineSchedule",
    "attention_ring",
    "attention_ring_bytes",
    "attention_ulysses",
    "attention_ulysses_bytes",
    "bubble_fraction_gpipe",
    "linear_attention",
    "linear_attention_allscan",
    "linear_attention_allscan_bytes",
    "linear_attention_lasp2",
    "linear_attention_lasp2_bytes",
    "linear_attention_lasp_ring",
    "pipeline_bytes",
    "pipeline_loss",
    "pipeline_run",
    "schedule_1f1b",
    "schedule_gpipe",
    "zigzag_order",
)
