"""What travels: encode/decode pairs with exact payload bytes. No collectives here."""

from jaxcomm.codecs._base import Codec
from jaxcomm.codecs._base import cast
from jaxcomm.codecs._base import flatten
from jaxcomm.codecs._base import identity
from jaxcomm.codecs._bits import index_dtype
from jaxcomm.codecs._bits import pack_bits
from jaxcomm.codecs._bits import packed_bytes
from jaxcomm.codecs._bits import unpack_bits
from jaxcomm.codecs._dct import dct_matrix
from jaxcomm.codecs._dct import dct_top_k
from jaxcomm.codecs._dct import largest_divisor
from jaxcomm.codecs._dct import tiled_dct_top_k
from jaxcomm.codecs._quantize import fp4
from jaxcomm.codecs._quantize import fp8
from jaxcomm.codecs._quantize import log_quant
from jaxcomm.codecs._quantize import qsgd
from jaxcomm.codecs._quantize import sign
from jaxcomm.codecs._quantize import uniform
from jaxcomm.codecs._sparse import random_k
from jaxcomm.codecs._sparse import rtop_k
from jaxcomm.codecs._sparse import top_k

__all__ = (
    "Codec",
    "cast",
    "dct_matrix",
    "dct_top_k",
    "flatten",
    "fp4",
    "fp8",
    "identity",
    "index_dtype",
    "largest_divisor",
    "log_quant",
    "pack_bits",
    "packed_bytes",
    "qsgd",
    "random_k",
    "rtop_k",
    "sign",
    "tiled_dct_top_k",
    "top_k",
    "uniform",
    "unpack_bits",
)
