"""The machine and software a run measured: recorded with every result so numbers can be compared honestly."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

from ztunnel.testing.envoy import find_envoy

_REPO = Path(__file__).resolve().parent.parent


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_mib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def _run(args: list[str], cwd: Path | None = None) -> str | None:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=10, cwd=cwd, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def envoy_version() -> str | None:
    binary = find_envoy()
    if binary is None:
        return None
    out = _run([binary, "--version"])
    if not out:
        return None
    # "<path>  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL"
    return out.split("version:", 1)[-1].strip()


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def collect() -> dict[str, Any]:
    """Versions, CPU, kernel and the source revision of this run."""
    cores = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = cores
    commit = _run(["git", "rev-parse", "HEAD"], _REPO)
    dirty = _run(["git", "status", "--porcelain", "--", "ztunnel", "bench", "xds"], _REPO)
    return {
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cores": cores,
        "usable_cores": usable,
        "mem_total_mib": _mem_total_mib(),
        "kernel": platform.release(),
        "os": platform.platform(),
        "loadavg_at_start": list(os.getloadavg()),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "openssl": ssl.OPENSSL_VERSION,
        "packages": {
            name: _version(name)
            for name in ("uvloop", "h2", "hyperframe", "hpack", "cryptography", "pyOpenSSL", "grpcio", "protobuf")
        },
        "envoy": envoy_version(),
        "git_commit": commit,
        "git_dirty_files": len(dirty.splitlines()) if dirty else 0,
        "sysctl": {
            k: _sysctl(k) for k in ("net.ipv4.tcp_tw_reuse", "net.ipv4.ip_local_port_range", "net.core.somaxconn")
        },
    }
