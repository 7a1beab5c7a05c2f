"""Envoy services (``envoy.service.*``)."""

from __future__ import annotations
