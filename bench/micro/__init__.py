"""Micro-benchmarks of the hot functions (pytest-benchmark): ``make bench-micro``, never part of ``make test``."""

from __future__ import annotations
