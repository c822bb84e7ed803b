"""Top-k 1 % with error feedback, the (index, value) pairs all-gathered; any codec spec of
jaxcomm.codecs: --config.method.codec=uniform:bits=8 --config.method.collective=two_phase."""

from .. import config


def get_config():
  return config.base_config("compressed", memory="ef")
