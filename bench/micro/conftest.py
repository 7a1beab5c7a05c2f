"""Shared set-up for the micro-benchmarks (``make bench-micro``; pytest-benchmark)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.micro.pipes import HbonePair, hbone_pair
from ztunnel import thirdparty


def pytest_configure(config: pytest.Config) -> None:
    # Measure the hot functions as the product runs them: App.start applies these patches (h2's frame repr, hpack's
    # DEBUG calls), and the benchmarks here drive the HBONE core without an App.
    thirdparty.apply()


@pytest.fixture
def pair() -> Iterator[HbonePair]:
    p = hbone_pair()
    try:
        yield p
    finally:
        p.close()
