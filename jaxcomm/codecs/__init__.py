"""What travels: codecs, encode/decode pairs with exact payload bytes. No collectives here.

The codec contract (write your own `Codec` to it; `jaxcomm.testing.check_codec` checks it):

* A codec works on ONE flat float32 vector of static length n. Transforms flatten the
  gradient tree first (`flatten`), so a step costs one encode and one collective.
* `encode(x, key) -> payload`: x is f32[n]. The payload is a tuple of arrays, exactly what
  goes on the wire, already in wire dtypes: bit codes packed into uint8 (`pack_bits`),
  indices in the narrowest unsigned integer (`index_dtype`), values and scales in float32 or
  a narrower float; no bool leaves, nothing wider than 32 bits. Shapes depend on n only,
  never on the values. `key` is a PRNG key for stochastic codecs and None for the others.
* `decode(payload, n) -> f32[n]`; shared-key codecs take the key too, `decode(payload, n,
  key)` (call `codec.decode_with(payload, n, key)` to decode either kind).
* `payload_bytes(n)`: the exact bytes of `encode`'s payload for n elements, a Python int.
  Wire-byte counters and byte formulas are built on it.
* Pure, jit-able, static-shape array code: codecs import nothing of jaxcomm outside
  `jaxcomm.codecs` and call no collectives; two-phase collectives vmap `encode` over chunks.

The flags are promises the collectives act on; a false one gives wrong sums without an
error, which is why `check_codec` tests each:

* `linear`: decode(sum of payloads) = sum of decodes, so payloads may be summed by psum.
  Non-linear codecs travel by gather (decode each worker's payload, sum in float32) or by
  the two-phase all-reduce (their preference is `collective`: "gather" or "two_phase").
* `stochastic`: `encode` draws random numbers from `key`; transforms then need a key
  (`key=...`). A codec without the flag is encoded with key=None.
* `shared_key`: `decode` needs the encoder's key, the same on every worker (random-k
  regenerates its indices from it instead of sending them).
* `error_bound(x)`: an upper bound on max |decode(encode(x)) - x| (traced); None means
  the codec is exact, and `check_codec` then holds it to the identity codec.
* `unbiased`: E_key decode(encode(x)) = x; `variance_bound(x)` bounds
  E_key ||decode(encode(x)) - x||^2.
* `length`: the one n the codec accepts. Such a codec needs the whole vector, so
  collectives that split the vector into chunks (two-phase, hierarchical axes, ZeRO's
  reduce-scatter) refuse it when the transform is built.
* `decode_sum(payloads, n)` (optional): the sum of the decodes of W payloads stacked on a
  leading axis, in one pass; the gather collective uses it (sparse codecs scatter-add all
  pairs into one vector and a transform codec inverts once instead of W times).

Shape-aware codecs: wherever a transform takes a codec it also takes a factory `shapes ->
Codec`, called with the parameter tree's leaf shapes in flat-vector order (`for_tree`), e.g.
`functools.partial(codecs.tiled_dct_top_k, chunk=64, k=32)` for DeMo's per-tensor tiles. A
codec made by a factory needs the whole vector.

Codecs by name (`load`, `parse`, `names`): a spec string `name:arg,key=value` names a factory
here (`top_k:fraction=0.01`), a module path or a `.py` file of your own that defines
`codec(...)`, as experiments load methods and models.

Helpers for writing codecs: `blocks`, `unblock`, `num_blocks` (per-block scales over a
vector whose length need not divide the block), `pack_bits`, `unpack_bits`,
`packed_bytes`, `index_dtype`, and `F32_SLACK` (a few float32 ulps, relative to max |x|,
to add to error bounds computed in float32).
"""

from jaxcomm.codecs._base import Codec
from jaxcomm.codecs._base import cast
from jaxcomm.codecs._base import flatten
from jaxcomm.codecs._base import identity
from jaxcomm.codecs._bits import F32_SLACK
from jaxcomm.codecs._bits import blocks
from jaxcomm.codecs._bits import index_dtype
from jaxcomm.codecs._bits import num_blocks
from jaxcomm.codecs._bits import pack_bits
from jaxcomm.codecs._bits import packed_bytes
from jaxcomm.codecs._bits import unblock
from jaxcomm.codecs._bits import unpack_bits
from jaxcomm.codecs._dct import dct_matrix
from jaxcomm.codecs._dct import dct_top_k
from jaxcomm.codecs._dct import largest_divisor
from jaxcomm.codecs._dct import tiled_dct_top_k
from jaxcomm.codecs._load import load
from jaxcomm.codecs._load import names
from jaxcomm.codecs._load import parse
from jaxcomm.codecs._quantize import fp4
from jaxcomm.codecs._quantize import fp8
from jaxcomm.codecs._quantize import log_quant
from jaxcomm.codecs._quantize import qsgd
from jaxcomm.codecs._quantize import sign
from jaxcomm.codecs._quantize import uniform
from jaxcomm.codecs._shaped import CodecLike
from jaxcomm.codecs._shaped import for_tree
from jaxcomm.codecs._shaped import payload_spec
from jaxcomm.codecs._shaped import splittable
from jaxcomm.codecs._shaped import validate
from jaxcomm.codecs._sparse import random_k
from jaxcomm.codecs._sparse import rtop_k
from jaxcomm.codecs._sparse import top_k

__all__ = (
    "Codec",
    "CodecLike",
    "F32_SLACK",
    "blocks",
    "cast",
    "dct_matrix",
    "dct_top_k",
    "flatten",
    "for_tree",
    "fp4",
    "fp8",
    "identity",
    "index_dtype",
    "largest_divisor",
    "load",
    "log_quant",
    "names",
    "num_blocks",
    "pack_bits",
    "packed_bytes",
    "parse",
    "payload_spec",
    "qsgd",
    "random_k",
    "rtop_k",
    "sign",
    "splittable",
    "tiled_dct_top_k",
    "top_k",
    "unblock",
    "uniform",
    "unpack_bits",
    "validate",
)
