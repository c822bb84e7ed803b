"""Layouts: sequence parallel attention (softmax and linear) and pipeline schedules."""

from jaxcomm.parallel._linear_attention import linear_attention
from jaxcomm.parallel._linear_attention import linear_attention_allscan
from jaxcomm.parallel._linear_attention import linear_attention_allscan_bytes
from jaxcomm.parallel._linear_attention import linear_attention_lasp2
from jaxcomm.parallel._linear_attention import linear_attention_lasp2_bytes
from jaxcomm.parallel._linear_attention import linear_attention_lasp_ring
from jaxcomm.parallel._ring_attention import attention_ring
from jaxcomm.parallel._ring_attention import attention_ring_bytes
from jaxcomm.parallel._ring_attention import zigzag_order
from jaxcomm.parallel._ulysses import attention_ulysses
from jaxcomm.parallel._ulysses import attention_ulysses_bytes

__all__ = (
    "attention_ring",
    "attention_ring_bytes",
    "attention_ulysses",
    "attention_ulysses_bytes",
    "linear_attention",
    "linear_attention_allscan",
    "linear_attention_allscan_bytes",
    "linear_attention_lasp2",
    "linear_attention_lasp2_bytes",
    "linear_attention_lasp_ring",
    "zigzag_order",
)
