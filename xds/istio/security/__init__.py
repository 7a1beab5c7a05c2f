"""L4 authorization policy API (``istio.security``)."""

from __future__ import annotations
