"""Workload discovery API (``istio.workload``): Address, Workload, Service."""

from __future__ import annotations
