"""Tests for the generated protobuf packages under ``xds``."""

from __future__ import annotations
