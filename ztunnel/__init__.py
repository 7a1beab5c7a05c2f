"""ztunnel: Istio ambient mesh's per-node L4 proxy, in Python on asyncio + uvloop."""

from __future__ import annotations

__version__ = "0.1.0"
