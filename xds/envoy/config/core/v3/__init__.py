"""Envoy core v3 types (``envoy.config.core.v3``): Node and Locality."""

from __future__ import annotations
