"""Envoy discovery services (``envoy.service.discovery.*``)."""

from __future__ import annotations
