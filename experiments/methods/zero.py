"""ZeRO stage 1 or 2 around the inner optimiser (`parallel.zero`), with an optional codec on
the gradient reduce-scatter. (Stage 3 is a layout: config.mesh with an `fsdp` axis.)"""

from .. import toolkit
from jaxcomm import parallel


def defaults():
  return toolkit.from_factory(parallel.zero, skip=("inner", "axis_name", "param_specs",
                                                  "regather", "key"),
                             types={"codec": str, "memory": str, "gather_codec": str})


def build(settings, ctx):
  if settings.stage == 3:
    raise ValueError("stage 3 keeps parameters sharded: use a mesh with an fsdp axis "
                     "(config.mesh = 'data=2,fsdp=4') and any method.")
  return toolkit.call(parallel.zero, settings, inner=ctx.inner, axis_name=ctx.axis_name,
                     codec=ctx.codec(settings.codec),
                     gather_codec=ctx.codec(settings.gather_codec, "gather_codec"), key=ctx.key)
