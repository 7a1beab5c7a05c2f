"""Upstream ztunnel (Rust) beside this one, in identical network-namespaced node pairs (root only).

Upstream's dedicated mode binds wildcard addresses (15001, 15006, 15008, 15021) and its SOCKS5 listener on
127.0.0.1:15080 only, so two of them cannot share a network namespace, nor reach each other on 127/8. Each node is
therefore a network namespace of its own (:mod:`ztunnel.testing.netns`: nodes on a bridge), and each
implementation gets a pair of nodes, built the same way and running the same configuration::

    node <impl>_a (172.172.0.x)                                   node <impl>_b (172.172.0.y)
      client -SOCKS5 127.0.0.1:15080-> ztunnel A ==HBONE :15008==> ztunnel B --> server 0.0.0.0:P    pair
      client -SOCKS5-> ztunnel A ==HBONE to its own :15008==> ztunnel A --> server 0.0.0.0:P           self-loop

Modes (``PAIR_MODES``): ``upstream`` and ``hbone-ns`` are the pair shape with upstream's binary and with this
ztunnel; ``upstream-loop`` and ``loop`` are upstream's own local-development recipe (one process, SOCKS5 -> its own
15008 -> the app) with each. ``hbone-ns`` is the partner every "vs upstream" ratio divides by upstream: the same
namespaces, veths, bridge, configuration and client as ``upstream``, so the ratio compares the proxies and not the
paths (``hbone`` runs on loopback without veths).

Both implementations run with ``FAKE_CA=true XDS_ADDRESS="" LOCAL_XDS_PATH=<workloads> PROXY_MODE=dedicated
PROXY_WORKLOAD_INFO=default/<client|server>/<sa> UNSTABLE_ENABLE_SOCKS5=true RUST_LOG=warn ENABLE_ORIG_SRC=false``
(upstream's inbound would otherwise spoof the client's address towards the app, whose answer then goes to the
other node). Upstream signs with its built-in test CA, this ztunnel with a local CA (``ZTUNNEL_CA_DIR``); each
pair trusts only itself. The workloads carry no policy, as in upstream's local-dev recipe, so that both do the
same work per connection.

``ZTUNNEL_WORKER_THREADS`` is upstream's variable too (its Tokio worker threads), so ``--workers 1`` runs
upstream with one worker thread against this ztunnel's one worker process.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.topology import APP_PORT, PATH_PROXIES, LogIssue, stop_servers, stop_ztunnels

UPSTREAM_ENV = "ZTUNNEL_UPSTREAM_BIN"
OURS, UPSTREAM = "ours", "upstream"
IMPLS = (OURS, UPSTREAM)
SOCKS5 = ("127.0.0.1", 15080)
READINESS_PORT = 15021


@dataclass(frozen=True)
class PairMode:
    impl: str
    loop: bool  # the self-loop (one process) rather than the pair


PAIR_MODES: dict[str, PairMode] = {
    "hbone-ns": PairMode(OURS, loop=False),
    "upstream": PairMode(UPSTREAM, loop=False),
    "loop": PairMode(OURS, loop=True),
    "upstream-loop": PairMode(UPSTREAM, loop=True),
}

# The proxies each mode's traffic crosses (their CPU and memory are the mode's cost). Names starting with
# "ztunnel" are this project's (the process-model checks look for worker processes under them).
PAIR_PROXIES: dict[str, tuple[str, ...]] = {m: PATH_PROXIES[m] for m in PAIR_MODES}

# "vs upstream": each of this ztunnel's modes and the upstream mode of the same shape.

_PROXY_NAMES = {OURS: ("ztunnel-ns-a", "ztunnel-ns-b"), UPSTREAM: ("upstream-a", "upstream-b")}
_CLIENT = {OURS: "ns-ours", UPSTREAM: "ns-upstream"}

WORKLOADS = """\
workloads:
- {{uid: "Kubernetes//Pod/default/client", name: client, namespace: default, serviceAccount: client,
   workloadIps: ["{a}"], protocol: HBONE, node: {impl}_a, network: "", canonicalName: client, workloadName: client,
   services: {{}}}}
- {{uid: "Kubernetes//Pod/default/server", name: server, namespace: default, serviceAccount: server,
   workloadIps: ["{b}"], protocol: HBONE, node: {impl}_b, network: "", canonicalName: echo, workloadName: server,
   services: {{}}}}
"""


def upstream_bin() -> str | None:
    """The upstream binary named by ``ZTUNNEL_UPSTREAM_BIN``, or None when unset."""
    return os.environ.get(UPSTREAM_ENV) or None


def upstream_skip_reason() -> str | None:
    """Why upstream's modes cannot run here (binary unset, missing, not executable; no namespaces), or None."""
    from ztunnel.testing.interop import upstream_problem

    return upstream_problem() or netns_skip_reason()


def netns_skip_reason() -> str | None:
    from ztunnel.testing import netns

    reason = netns.skip_reason()
    return f"needs network namespaces: {reason}" if reason else None


def pair_skip_reason(mode: str) -> str | None:
    """Why ``mode`` (of :data:`PAIR_MODES`) cannot run here, or None. This ztunnel's namespaced modes exist to be
    divided by upstream's, so they are skipped with them."""
    reason = upstream_skip_reason()
    if reason is None:
        return None
    if PAIR_MODES[mode].impl == OURS:
        return f"only measured beside upstream, which cannot run: {reason}"
    return reason


class NodePairs:
    """The node pairs of the selected :data:`PAIR_MODES`: namespaces, a server in every node, one client process
    per pair (in node A, where the SOCKS5 listener is), the ztunnels per start."""

    def __init__(self, workdir: Path, modes: tuple[str, ...], ztunnel_env: Mapping[str, str], reps: int) -> None:
        from ztunnel.identity.ca import LocalCA
        from ztunnel.testing import netns

        self.workdir = workdir
        self.modes = tuple(m for m in modes if m in PAIR_MODES)
        self.impls = tuple(i for i in IMPLS if any(PAIR_MODES[m].impl == i for m in self.modes))
        self.ztunnel_env = dict(ztunnel_env)
        self.reps = max(1, reps)
        self.rep = 0
        self.servers: list[subprocess.Popen[bytes]] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.topo = netns.Topology()
        try:
            self.nodes = {(i, s): self.topo.node(f"{i}_{s}") for i in self.impls for s in ("a", "b")}
            self.configs: dict[str, Path] = {}
            for impl in self.impls:
                cfg = workdir / f"{impl}-workloads.yaml"
                cfg.write_text(WORKLOADS.format(a=self.nodes[(impl, "a")].ip, b=self.nodes[(impl, "b")].ip, impl=impl))
                self.configs[impl] = cfg
            self.ca_dir = workdir / "ns-ca"
            if OURS in self.impls:
                LocalCA.load_or_create(self.ca_dir, "cluster.local")
        except BaseException:
            self.topo.close()
            raise

    @property
    def clients(self) -> tuple[str, ...]:
        return tuple(_CLIENT[i] for i in self.impls)

    def client_prefix(self, name: str) -> list[str]:
        impl = next(i for i, c in _CLIENT.items() if c == name)
        return self.nodes[(impl, "a")].command([])

    def server_port(self, rep: int | None = None) -> int:
        return APP_PORT + (self.rep if rep is None else rep)

    def start_server(self) -> None:
        """A bench server in every node, on 0.0.0.0 and one port per repetition (A serves the self-loop, B the
        pair)."""
        for (impl, side), node in self.nodes.items():
            args = [sys.executable, "-m", "bench.server"]
            for r in range(self.reps):
                args += ["--listen", f"0.0.0.0:{self.server_port(r)}"]
            with open(self.workdir / f"server-{impl}-{side}.log", "wb") as log:
                proc = node.popen(args, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
            self.servers.append(proc)
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"bench server in node {node.node} did not start; see its log in {self.workdir}")

    def _env(self, impl: str, side: str, extra: Mapping[str, str]) -> dict[str, str]:
        sa = "client" if side == "a" else "server"
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", "/"),
            "FAKE_CA": "true",
            "XDS_ADDRESS": "",
            "LOCAL_XDS_PATH": str(self.configs[impl]),
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": f"default/{sa}/{sa}",
            "UNSTABLE_ENABLE_SOCKS5": "true",
            "ENABLE_ORIG_SRC": "false",
            "RUST_LOG": "warn",
            **self.ztunnel_env,
            **extra,
        }
        if impl == OURS:
            env["ZTUNNEL_CA_DIR"] = str(self.ca_dir)
        return env

    def start_proxies(self, logdir: Path, rep: int, env: Mapping[str, str] | None) -> None:
        self.rep = rep
        extra = dict(env or {})
        for impl in self.impls:
            argv = [upstream_bin() or "ztunnel"] if impl == UPSTREAM else [sys.executable, "-m", "ztunnel"]
            for side, name in zip(("a", "b"), _PROXY_NAMES[impl], strict=True):
                self.logs[name] = logdir / f"{name}.log"
                with open(self.logs[name], "wb") as log:
                    self.procs[name] = self.nodes[(impl, side)].popen(
                        [*argv, "proxy", "ztunnel"],
                        env=self._env(impl, side, extra),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
        for impl in self.impls:
            for side, name in zip(("a", "b"), _PROXY_NAMES[impl], strict=True):
                self._wait_ready(name, self.nodes[(impl, side)])

    def _wait_ready(self, name: str, node: Any, timeout: float = 30.0) -> None:
        """Until the process answers 200 on its readiness port (inside its node), or fail with its log."""

        def probe() -> int:
            conn = http.client.HTTPConnection("127.0.0.1", READINESS_PORT, timeout=2)
            try:
                conn.request("GET", "/healthz/ready")
                return conn.getresponse().status
            finally:
                conn.close()

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                break
            try:
                if node.run(probe) == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        tail = self.logs[name].read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{name} (node {node.node}) not ready within {timeout:g}s; log {self.logs[name]}:\n{tail}")

    def stop_proxies(self) -> list[LogIssue]:
        issues = stop_ztunnels(self.procs, self.logs)
        self.procs = {}
        return issues

    def proxy_pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def server_pids(self) -> dict[str, int]:
        return {f"ns-server-{i}": s.pid for i, s in enumerate(self.servers)}

    def client_ip(self, mode: str, rep: int | None = None) -> str:
        """A source address on node A's loopback per (mode, repetition): every repetition's 15,000-30,000
        connections to 127.0.0.1:15080 get a 4-tuple space of their own (TIME_WAIT, see the loopback topology)."""
        r = self.rep if rep is None else rep
        return f"127.1.{r + 1}.{list(PAIR_MODES).index(mode) + 2}"

    def route(self, mode: str) -> dict[str, Any]:
        pm = PAIR_MODES[mode]
        target = self.nodes[(pm.impl, "a" if pm.loop else "b")].ip
        return {
            "addr": list(SOCKS5),
            "socks": [target, self.server_port()],
            "bind": self.client_ip(mode),
            "client": _CLIENT[pm.impl],
        }

    def describe(self) -> dict[str, Any]:
        return {
            "nodes": {f"{i}_{s}": n.ip for (i, s), n in self.nodes.items()},
            "upstream_bin": upstream_bin(),
            "modes": {m: PAIR_PROXIES[m] for m in self.modes},
            "env": {k: v for k, v in self._env(self.impls[0], "a", {}).items() if k not in ("PATH", "HOME")},
        }

    def close(self) -> list[LogIssue]:
        issues = self.stop_proxies()
        stop_servers(self.servers)
        self.servers = []
        self.topo.close()
        return issues
