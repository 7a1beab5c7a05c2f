"""Istio CA certificate signing API (``istio.v1.auth``)."""

from __future__ import annotations
