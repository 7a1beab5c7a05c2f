"""What a benchmark topology is: the modes, the proxies on each mode's path, the interface the runner drives, and
the scan of the processes' logs.

The topologies themselves: :mod:`bench.loopback_topology` (the default; no root) and :mod:`bench.netns_topology`
(network namespaces and iptables capture; root); :mod:`bench.topologies` picks one by name. This module imports
neither, so both can import it.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# The loopback modes, then upstream's comparison in namespaced node pairs (bench.node_pairs).
LOOPBACK_MODES = ("direct", "tcp", "hbone", "envoy")
PAIR_MODES = ("hbone-ns", "upstream", "loop", "upstream-loop")
MODES = (*LOOPBACK_MODES, *PAIR_MODES)
APP_PORT = 8080

# Which proxy processes carry each mode's traffic (their CPU and memory are the mode's cost).
PATH_PROXIES: dict[str, tuple[str, ...]] = {
    "direct": (),
    "tcp": ("ztunnel-a",),
    "hbone": ("ztunnel-a", "ztunnel-b"),
    "envoy": ("envoy-originator", "envoy-terminator"),
    # bench.node_pairs.PAIR_PROXIES (kept here so this module imports no topology)
    "hbone-ns": ("ztunnel-ns-a", "ztunnel-ns-b"),
    "upstream": ("upstream-a", "upstream-b"),
    "loop": ("ztunnel-ns-a",),
    "upstream-loop": ("upstream-a",),
}

ZTUNNEL_PROBLEM = re.compile(r"\t(warn|error)\t|Traceback|\"level\": \"(warn|error)\"")
ENVOY_PROBLEM = re.compile(r"\]\[(warning|error|critical)\]")


@dataclass
class LogIssue:
    process: str
    path: str
    count: int
    examples: list[str] = field(default_factory=list)


# Expected in every run: Envoy's start-up advice about connection limits, and the SIGTERM we send it.
_BENIGN = re.compile(r"no configured limit to the number of allowed active downstream connections|caught ENVOY_SIGTERM")


def scan_log(process: str, path: Path, pattern: re.Pattern[str]) -> LogIssue | None:
    """Warnings and errors in a proxy's log (the benchmark expects none)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    hits = [line for line in lines if pattern.search(line) and not _BENIGN.search(line)]
    if not hits:
        return None
    examples: list[str] = []
    for line in hits:
        short = line[:300]
        if short not in examples:
            examples.append(short)
        if len(examples) >= 5:
            break
    return LogIssue(process, str(path), len(hits), examples)


def stop_ztunnels(procs: Mapping[str, subprocess.Popen[bytes]], logs: Mapping[str, Path]) -> list[LogIssue]:
    """SIGTERM every ztunnel, then wait (15 s each, then SIGKILL); what each did wrong: an exit status other than 0
    after SIGTERM, warnings or errors in its log."""
    issues: list[LogIssue] = []
    for proc in procs.values():
        proc.terminate()
    for name, proc in procs.items():
        try:
            code = proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if code != 0:
            issues.append(LogIssue(name, str(logs[name]), 1, [f"exit status {code} after SIGTERM"]))
        found = scan_log(name, logs[name], ZTUNNEL_PROBLEM)
        if found is not None:
            issues.append(found)
    return issues


def stop_servers(servers: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the app servers, then wait (5 s each, then SIGKILL); their stdout pipes closed."""
    for s in servers:
        s.terminate()
        try:
            s.wait(5)
        except subprocess.TimeoutExpired:
            s.kill()
            s.wait()
        if s.stdout is not None:
            s.stdout.close()


class Topology(Protocol):
    """What the runner needs from a topology: processes to start and stop, and a route per mode."""

    name: str
    clients: tuple[str, ...]  # the client processes to start (routes name theirs in "client")

    def start_server(self) -> None: ...
    def client_prefix(self, name: str) -> list[str]: ...
    def start_proxies(self, logdir: Path, rep: int = 0, env: Mapping[str, str] | None = None) -> None:
        """Fresh proxies for repetition ``rep``; ``env``: extra environment for the ztunnels of this start."""

    def stop_proxies(self) -> list[LogIssue]: ...
    def proxy_pids(self) -> dict[str, int]: ...
    def pids(self) -> dict[str, int]: ...
    def envoy_stats(self) -> dict[str, int]: ...
    def route(self, mode: str) -> dict[str, Any]: ...
    def controlplane_target(self) -> tuple[Path, str]: ...
    def describe(self) -> dict[str, Any]: ...
    def close(self) -> list[LogIssue]: ...


def wait_settled(seconds: float) -> None:
    """Let the proxies finish closing connections and freeing memory before a measurement."""
    time.sleep(seconds)
