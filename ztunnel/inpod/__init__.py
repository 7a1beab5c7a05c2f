"""In-pod mode: ztunnel serving every pod of its node inside the pods' network namespaces (ZDS with istio-cni)."""

from __future__ import annotations
