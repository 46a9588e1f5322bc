"""Test configuration: 8 fake CPU devices and float64 where a test asks for it.

The XLA flag must be set before jax is imported anywhere, so it lives here, at
the top of the first module pytest imports.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64():
  """Runs a test with float64 enabled, restoring the previous setting after."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


@pytest.fixture(scope="session")
def main_cache(tmp_path_factory):
  """JAX compilation cache shared by the ``experiments.main`` subprocesses of one session."""
  return tmp_path_factory.mktemp("jax_cache")
