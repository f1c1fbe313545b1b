"""Shared set-up of the pytest-benchmark suites (``python -m pytest benches``).

Every group holds an ``async_array`` case and its plain twin,
run back to back in this one process so that a noisy machine hits both alike;
``benches/run_all.py`` reads the medians and prints the ratios. ``--quick``
runs fewer rounds (what ``make bench`` uses).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", help="fewer rounds (make bench)")


@pytest.fixture(scope="session")
def rounds(request: pytest.FixtureRequest) -> int:
    """Rounds of a slow case (one that takes a second or more a round)."""
    return 3 if request.config.getoption("--quick") else 7


@pytest.fixture(scope="session", autouse=True)
def _jax_started() -> None:
    # JAX's one-time start-up (backend, first compile) is paid by no case.
    jax.jit(jnp.sin)(1.0).block_until_ready()
