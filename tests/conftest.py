"""Eight emulated CPU devices for every test, set once before JAX starts a backend."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def mesh8():
  from jaxcomm import train  # pylint: disable=import-outside-toplevel
  return train.make_mesh({"data": 8})


@pytest.fixture(scope="session")
def mesh4x2():
  from jaxcomm import train  # pylint: disable=import-outside-toplevel
  return train.make_mesh({"data": 4, "tensor": 2})
