"""Tests for the local control plane (``ztunnel.standins.istiod``)."""

from __future__ import annotations
