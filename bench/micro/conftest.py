"""Shared set-up for the micro-benchmarks (``make bench-micro``; pytest-benchmark)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.micro.pipes import HbonePair, hbone_pair


@pytest.fixture
def pair() -> Iterator[HbonePair]:
    p = hbone_pair()
    try:
        yield p
    finally:
        p.close()
