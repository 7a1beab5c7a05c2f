"""Test suite."""

from __future__ import annotations
