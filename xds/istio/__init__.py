"""Istio APIs (package ``istio.*``)."""

from __future__ import annotations
