"""What travels: encode/decode pairs with exact payload bytes. No collectives here."""

from jaxcomm.codecs._base import Codec
from jaxcomm.codecs._base import cast
from jaxcomm.codecs._base import flatten
from jaxcomm.codecs._base import identity

__all__ = (
    "Codec",
    "cast",
    "flatten",
    "identity",
)
