"""A worker process imports no gRPC, no aiohttp and none of the control-plane code: checked in a fresh interpreter
that imports what ``python -m ztunnel.workers`` does (tests/workers/test_processes.py checks a running worker's
loaded libraries too)."""

from __future__ import annotations

import subprocess
import sys

# Top-level packages and ztunnel modules a worker must never load: the RPC stacks, the HTTP servers' framework, the
# protobuf runtime, and what talks to istiod, istio-cni or the operator.
FORBIDDEN = (
    "grpc",
    "aiohttp",
    "google.protobuf",
    "xds",
    "ztunnel.app",
    "ztunnel.admin",
    "ztunnel.readiness",
    "ztunnel.xds",
    "ztunnel.control",
    "ztunnel.cert_fetcher",
    "ztunnel.identity.caclient",
    "ztunnel.localconfig",
    "ztunnel.inpod.protocol",
    "ztunnel.inpod.statemanager",
    "ztunnel.inpod.workloadmanager",
    "ztunnel.standins",
    "ztunnel.workers.supervisor",
)


def loaded_after(*modules: str) -> set[str]:
    code = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(out.stdout.split())


def forbidden(loaded: set[str]) -> list[str]:
    return sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


def test_the_worker_imports_none_of_the_control_process() -> None:
    loaded = loaded_after("ztunnel.workers.__main__", "ztunnel.workers.worker", "uvloop")
    assert "ztunnel.proxyfactory" in loaded and "ztunnel.dns.server" in loaded  # it did import the data plane
    assert forbidden(loaded) == []


def test_the_check_sees_the_control_process() -> None:
    loaded = loaded_after("ztunnel.app", "ztunnel.xds.client")
    assert {"grpc", "ztunnel.admin", "ztunnel.workers.supervisor", "ztunnel.xds.client"} <= set(forbidden(loaded))
