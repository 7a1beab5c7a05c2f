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


# Modules a worker never uses though code it shares with the control process could import them at start: PyYAML
# (only the control process parses YAML), the profiler (imported on the first profiling request), prometheus-client
# (the control process's /metrics parses nothing of it: a worker's families are ztunnel.metrics' own) and dnspython's
# resolver (a worker reads resolv.conf with ztunnel.dns.forwarder.ResolvConf). Each would cost every worker its
# objects (docs/process-model.md, "A worker's idle memory").
UNUSED = ("yaml", "ztunnel.profiling", "tracemalloc", "prometheus_client", "dns.resolver")


def loaded_after(*modules: str) -> set[str]:
    code = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(out.stdout.split())


def forbidden(loaded: set[str], names: tuple[str, ...] = FORBIDDEN) -> list[str]:
    return sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in names))


def test_the_worker_imports_none_of_the_control_process() -> None:
    loaded = loaded_after("ztunnel.workers.__main__", "ztunnel.workers.worker", "uvloop")
    assert "ztunnel.proxyfactory" in loaded and "ztunnel.dns.server" in loaded  # it did import the data plane
    assert forbidden(loaded) == []
    assert forbidden(loaded, UNUSED) == []


def test_the_unused_check_sees_them() -> None:
    loaded = loaded_after("ztunnel.localconfig", "ztunnel.profiling", "prometheus_client", "dns.resolver")
    assert set(UNUSED) <= set(forbidden(loaded, UNUSED))


def test_the_check_sees_the_control_process() -> None:
    loaded = loaded_after("ztunnel.app", "ztunnel.xds.client")
    assert {"grpc", "ztunnel.admin", "ztunnel.workers.supervisor", "ztunnel.xds.client"} <= set(forbidden(loaded))


# Runs the ztunnel command as deployed, but records the modules the process has at the moment it forks its first
# worker (what each of them starts with: after ``Preforked.start`` imported the data plane), then lets it go on; the
# test stops it once it is ready.
AT_FORK = """
import json, os, sys
fork = os.fork
def recording():
    if not os.path.exists(sys.argv[1]):
        with open(sys.argv[1], "w") as f:
            json.dump(sorted(sys.modules), f)
    return fork()
os.fork = recording
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
        assert {"ztunnel.config", "ztunnel.workers.worker"} <= loaded  # the record is of a real fork
        assert forbidden(loaded) == []
        assert forbidden(loaded, UNUSED) == []
    finally:
        assert z.stop() == 0


# Runs the ztunnel command as deployed, but records the pid of every process that looks up an installed package's
# version (importlib.metadata.version: what ztunnel/thirdparty.py asks before it patches a library).
VERSION_LOOKUPS = """
import importlib.metadata, os, sys
version = importlib.metadata.version
def recording(name):
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()} {name}\\n")
    return version(name)
importlib.metadata.version = recording
from ztunnel.__main__ import main
sys.exit(main(["proxy"]))
"""


def test_forked_workers_look_up_no_package_versions(tmp_path: Path) -> None:
    """The patches' version checks are made once, before the workers are forked: no worker repeats them (each
    lookup walks every installed package's metadata, memory a worker would then hold privately)."""
    m = TwoNodeMesh(tmp_path)
    record = tmp_path / "lookups"
    z = ZtunnelProcess(
        m.env_a(ZTUNNEL_WORKER_THREADS="2"),
        tmp_path / "a.log",
        argv=[sys.executable, "-c", VERSION_LOOKUPS, str(record)],
    ).start()
    try:
        workers = z.children()
        assert len(workers) == 2
        lookups = [line.split() for line in record.read_text().splitlines()]
        assert {"hpack", "aiohttp"} <= {name for _, name in lookups}  # the record is of real checks
        assert z.proc is not None
        assert {int(pid) for pid, _ in lookups} == {z.proc.pid}
    finally:
        assert z.stop() == 0
