"""Envoy configuration types (``envoy.config.*``)."""

from __future__ import annotations
