"""Envoy xDS APIs (package ``envoy.*``), only what ztunnel uses."""

from __future__ import annotations
