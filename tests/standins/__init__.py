"""Tests for the stand-ins of istiod and istio-cni (``ztunnel.standins``)."""

from __future__ import annotations
