"""Tests for istio-cni's stand-in, the node agent (``ztunnel.standins.cni``)."""

from __future__ import annotations
