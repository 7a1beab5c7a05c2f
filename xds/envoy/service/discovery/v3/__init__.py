"""Aggregated discovery service, state-of-the-world and delta (``envoy.service.discovery.v3``)."""

from __future__ import annotations
