"""Protocol definitions wire-compatible with Istio's ztunnel: workload, security, CA, delta xDS and ZDS."""

from __future__ import annotations
