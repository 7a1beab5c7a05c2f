"""A worker process imports no gRPC, no aiohttp and none of the control-plane code: checked in a fresh interpreter
that imports what ``python -m ztunnel.workers`` does (a worker started later), and at the moment the ztunnel command
forks its first workers (tests/workers/test_processes.py checks a running worker's loaded libraries too)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ztunnel.testing import TwoNodeMesh, ZtunnelProcess

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


# Runs the ztunnel command as deployed, but records the modules the process has at the moment it forks its first
# workers (what each of them starts with), then lets it go on; the test stops it once it is ready.
AT_FORK = """
import json, sys
from ztunnel.workers import prefork
start = prefork.Preforked.start.__func__
def recording(cls, count):
    with open(sys.argv[1], "w") as f:
        json.dump(sorted(sys.modules), f)
    return start(cls, count)
prefork.Preforked.start = classmethod(recording)
from ztunnel.__main__ import main
sys.exit(main(["proxy"]))
"""


def test_workers_forked_at_start_have_none_of_the_control_process(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    record = tmp_path / "modules.json"
    z = ZtunnelProcess(
        m.env_a(ZTUNNEL_WORKER_THREADS="2"), tmp_path / "a.log", argv=[sys.executable, "-c", AT_FORK, str(record)]
    ).start()
    try:
        assert len(z.children()) == 2
        loaded = set(json.loads(record.read_text()))
        assert "ztunnel.config" in loaded  # the record is of a real start
        assert forbidden(loaded) == []
    finally:
        assert z.stop() == 0
