"""Istio v1 APIs (``istio.v1.*``)."""

from __future__ import annotations
