"""Shared test set-up.

Four CPU devices (set before JAX is imported) let sharding tests run on this
machine; the default device stays CPU 0.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax

assert len(jax.devices()) >= 1


import pytest  # noqa: E402

import async_array as aa  # noqa: E402


@pytest.fixture
def pool_size():
    """Sets the pool size for one test (``pool_size(n)``), restoring the default after."""
    yield aa.configure
    aa.configure()
