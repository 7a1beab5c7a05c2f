"""ZDS, the istio-cni to ztunnel in-pod protocol (``istio.workload.zds``)."""

from __future__ import annotations
