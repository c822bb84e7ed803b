"""The LM laid out on a mesh: DP x ZeRO-3 x Megatron tensor parallelism by default;
--config.mesh=data=2,tensor=4 --config.model.sequence_parallel=True,
--config.mesh=data=2,sequence=4 --config.model.attention=ulysses, or
--config.mesh=data=2,pipeline=4 --config.model.schedule=gpipe."""

from .. import config


def get_config():
  c = config.base_config("dp")
  c.mesh = "data=2,fsdp=2,tensor=2"
  return c
