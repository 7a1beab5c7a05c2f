"""Local benchmark harness: ztunnel against direct TCP and Envoy, measured side by side."""

from __future__ import annotations
