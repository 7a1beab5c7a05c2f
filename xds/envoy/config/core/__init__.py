"""Envoy core configuration types (``envoy.config.core.*``)."""

from __future__ import annotations
