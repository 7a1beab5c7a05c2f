"""The loopback topology (the default): the processes a benchmark run measures, and how a client reaches the server
in each mode.

Loopback topology (the default; no root needed), on a random 127/8 block of the two-node example
(:class:`ztunnel.testing.TwoNodeMesh`), so a run never collides with tests or another run::

    direct  client ----------------------------------------------------------------> server   node B:P
    tcp     client --SOCKS5--> ztunnel A --plain TCP (passthrough)-----------------> server   plain:P
    hbone   client --SOCKS5--> ztunnel A ==HBONE (mTLS, HTTP/2 CONNECT)==> ztunnel B --> server   node B:P
    envoy   client ----------> Envoy originator ==HBONE (mTLS, HTTP/2 CONNECT)==> Envoy terminator --> server   node B:P

* ``tcp`` asks ztunnel A for the ``plain`` workload's IP, which the config marks as outside the mesh (protocol
  TCP): ztunnel passes the connection through without a tunnel. The server listens there too.
* ``hbone`` asks for the server pod's IP: ztunnel A finds the workload (HBONE-capable, on node B) and tunnels
  to ztunnel B, which checks the L4 policies (two apply) and connects to the server. The pod IP rather than the
  service VIP, because the server port P changes every repetition (see below) and Envoy has no load balancing
  step either.
* ``envoy`` is the same shape with Envoy on both ends (``tcp_proxy`` tunnelling, HTTP/2, TLS 1.3, the client's and
  server's SPIFFE certificates from the same CA, each checking the other's URI SAN; ``--concurrency 1``; upstream
  ztunnel's windows; no access log). Envoy's originator takes plain TCP directly: there is no SOCKS5 step.

Each proxy is its own process (ztunnel A, ztunnel B, Envoy originator, Envoy terminator), the server another, and
clients others again (``bench.worker``). Proxies are started fresh for every repetition (idle memory is measured on
fresh processes); the server lives for the whole run.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.topology import APP_PORT, ENVOY_PROBLEM, LOOPBACK_MODES, PAIR_MODES, ZTUNNEL_PROBLEM, LogIssue, scan_log
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.testing import TwoNodeMesh, ZtunnelProcess
from ztunnel.testing.envoy import (
    ORIGINATOR_LISTENER,
    TERMINATOR_LISTENER,
    Envoy,
    EnvoyTls,
    originator_config,
    terminator_config,
)

TRUST_DOMAIN = "cluster.local"
CLIENT_ID = Identity(TRUST_DOMAIN, "default", "client")
SERVER_ID = Identity(TRUST_DOMAIN, "default", "server")

# Envoy's default circuit breakers cap a cluster at 1,024 connections, pending requests and concurrent requests:
# the 1,025th concurrent tunnel would be refused. ztunnel has no such cap, so the benchmark lifts Envoy's.
_UNLIMITED_CIRCUIT_BREAKERS = {
    "thresholds": [
        {
            "priority": "DEFAULT",
            "max_connections": 1_000_000,
            "max_pending_requests": 1_000_000,
            "max_requests": 1_000_000,
            "max_retries": 1_000_000,
        }
    ]
}


def _lift_circuit_breakers(bootstrap: dict[str, Any]) -> dict[str, Any]:
    for cluster in bootstrap["static_resources"]["clusters"]:
        cluster["circuit_breakers"] = _UNLIMITED_CIRCUIT_BREAKERS
    return bootstrap


class LoopbackTopology:
    """The two-node mesh on loopback with a server, two ztunnels and an Envoy pair, as the modes need."""

    name = "loopback"
    clients: tuple[str, ...] = ("default",)

    def __init__(
        self, workdir: Path, modes: Iterable[str], ztunnel_env: dict[str, str] | None = None, reps: int = 1
    ) -> None:
        self.workdir = workdir
        self.modes = tuple(modes)
        self.reps = max(1, reps)
        self.rep = 0
        self.mesh = TwoNodeMesh(workdir)
        self.ztunnel_env = dict(ztunnel_env or {})
        # The CA ztunnels use with FAKE_CA (ZTUNNEL_CA_DIR); created here, before any of them races to create it.
        self.ca = LocalCA.load_or_create(self.mesh.ca_dir, TRUST_DOMAIN)
        self.server: subprocess.Popen[bytes] | None = None
        self.ztunnels: dict[str, ZtunnelProcess] = {}
        self.envoys: dict[str, Envoy] = {}
        self._envoy_tls: tuple[EnvoyTls, EnvoyTls] | None = None
        self._logdir = workdir
        octets = self.mesh.node_a.split(".")
        # The mesh uses 127.n.(k+1..k+4).*; 127.n.(k+5).* belongs to no TwoNodeMesh block: node C of the
        # control-plane scenario, and the clients' source addresses.
        spare = f"127.{octets[1]}.{int(octets[2]) + 4}"
        self.spare_ip = f"{spare}.1"
        self._spare = spare
        if len(LOOPBACK_MODES) * self.reps + 11 > 254:
            raise ValueError(f"at most {(254 - 11) // len(LOOPBACK_MODES)} repetitions")
        # Upstream's comparison (bench.node_pairs): node pairs in network namespaces, beside the loopback modes.
        self.pairs: Any = None
        if any(m in PAIR_MODES for m in self.modes):
            from bench.node_pairs import NodePairs

            self.pairs = NodePairs(workdir, self.modes, self.ztunnel_env, self.reps)
        self.clients = ("default", *(self.pairs.clients if self.pairs is not None else ()))

    # -- the server ----------------------------------------------------------------------------------------------

    # -- addresses: fresh 4-tuples every repetition ---------------------------------------------------------------
    #
    # A repetition opens some 15,000-30,000 connections on each hop, and every closed one keeps its port in TIME_WAIT
    # for 60 s on the side that closed first. On one 4-tuple space (one source IP, one destination address) the next
    # repetition would find the 28,000-port ephemeral range nearly exhausted, and connect() slows down as it scans
    # for free ports: that measured the kernel, not the proxies (a 10,000-tunnel open took 22 s instead of 7). So each
    # repetition uses its own server port, and each (mode, repetition) its own client source address.

    def server_port(self, rep: int | None = None) -> int:
        return APP_PORT + (self.rep if rep is None else rep)

    def client_ip(self, mode: str, rep: int | None = None) -> str:
        r = self.rep if rep is None else rep
        return f"{self._spare}.{11 + r * len(LOOPBACK_MODES) + LOOPBACK_MODES.index(mode)}"

    def client_prefix(self, name: str) -> list[str]:
        if name != "default" and self.pairs is not None:
            return list(self.pairs.client_prefix(name))
        return []

    def controlplane_target(self) -> tuple[Path, str]:
        return self.mesh.config, self.spare_ip

    def start_server(self) -> None:
        addrs = [f"{ip}:{self.server_port(r)}" for r in range(self.reps) for ip in (self.mesh.node_b, self.mesh.plain)]
        args = [sys.executable, "-m", "bench.server"]
        for a in addrs:
            args += ["--listen", a]
        log = open(self.workdir / "server.log", "wb")  # noqa: SIM115 - the child holds it; closed with the process
        self.server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        if self.pairs is not None:
            self.pairs.start_server()
        assert self.server.stdout is not None
        line = self.server.stdout.readline()
        if line.strip() != b"ready":
            self.server.kill()
            raise RuntimeError(f"bench server did not start: {(self.workdir / 'server.log').read_text()[-2000:]}")

    # -- proxies -------------------------------------------------------------------------------------------------

    def _needs_ztunnel(self) -> bool:
        return "tcp" in self.modes or "hbone" in self.modes

    def start_proxies(self, logdir: Path, rep: int = 0, env: Mapping[str, str] | None = None) -> None:
        """Start fresh proxies for repetition ``rep`` (in parallel), logs in ``logdir``; ``env`` is added to the
        ztunnels' environment for this start (a process model of ``--workers``)."""
        self.rep = rep
        logdir.mkdir(parents=True, exist_ok=True)
        self._logdir = logdir
        jobs: list[Callable[[], object]] = []
        if self._needs_ztunnel():
            zenv = {"RUST_LOG": "warn", **self.ztunnel_env, **(env or {})}
            self.ztunnels = {
                "ztunnel-a": ZtunnelProcess(self.mesh.env_a(**zenv), logdir / "ztunnel-a.log"),
                "ztunnel-b": ZtunnelProcess(self.mesh.env_b(**zenv), logdir / "ztunnel-b.log"),
            }
            jobs += [z.start for z in self.ztunnels.values()]
        if "envoy" in self.modes:
            jobs.append(lambda: self._start_envoys(logdir))
        if self.pairs is not None:
            pairs = self.pairs
            jobs.append(lambda: pairs.start_proxies(logdir, rep, env))
        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            for fut in [pool.submit(job) for job in jobs]:
                fut.result()

    def _start_envoys(self, logdir: Path) -> None:
        if self._envoy_tls is None:
            certs = self.workdir / "envoy-certs"
            ttl = timedelta(hours=12)
            self._envoy_tls = (
                EnvoyTls.write(self.ca.issue(CLIENT_ID, ttl), certs, "client"),
                EnvoyTls.write(self.ca.issue(SERVER_ID, ttl), certs, "server"),
            )
        client_tls, server_tls = self._envoy_tls
        terminator = Envoy(
            _lift_circuit_breakers(
                terminator_config(
                    listen=(self.mesh.node_b, 0),
                    upstream=(self.mesh.node_b, self.server_port()),
                    tls=server_tls,
                    client_sans=[str(CLIENT_ID)],
                )
            ),
            logdir,
            name="envoy-terminator",
        )
        terminator.start()
        self.envoys["envoy-terminator"] = terminator
        originator = Envoy(
            _lift_circuit_breakers(
                originator_config(
                    listen=(self.mesh.node_a, 0),
                    hbone=terminator.listener_address(TERMINATOR_LISTENER),
                    tunnel_hostname=f"{self.mesh.node_b}:{self.server_port()}",
                    tls=client_tls,
                    expected_sans=[str(SERVER_ID)],
                )
            ),
            logdir,
            name="envoy-originator",
        )
        originator.start()
        self.envoys["envoy-originator"] = originator

    def stop_proxies(self) -> list[LogIssue]:
        """Stop every proxy; returns the warnings/errors their logs contain, and non-zero exits."""
        issues: list[LogIssue] = []
        for name, z in self.ztunnels.items():
            code = z.stop() if z.proc is not None else 0
            if code != 0:
                issues.append(LogIssue(name, str(z.log_path), 1, [f"exit status {code} after SIGTERM"]))
            if z.log_path is not None:
                found = scan_log(name, z.log_path, ZTUNNEL_PROBLEM)
                if found is not None:
                    issues.append(found)
        for name, e in self.envoys.items():
            e.stop()
            found = scan_log(name, e.log_path, ENVOY_PROBLEM)
            if found is not None:
                issues.append(found)
        self.ztunnels, self.envoys = {}, {}
        if self.pairs is not None:
            issues += self.pairs.stop_proxies()
        return issues

    def proxy_pids(self) -> dict[str, int]:
        pids: dict[str, int] = {}
        for name, z in self.ztunnels.items():
            if z.proc is not None:
                pids[name] = z.proc.pid
        for name, e in self.envoys.items():
            if e.proc is not None:
                pids[name] = e.proc.pid
        if self.pairs is not None:
            pids.update(self.pairs.proxy_pids())
        return pids

    def pids(self) -> dict[str, int]:
        """Every measured process but the clients: proxies and the server."""
        out = self.proxy_pids()
        if self.server is not None:
            out["server"] = self.server.pid
        if self.pairs is not None:
            out.update(self.pairs.server_pids())
        return out

    def envoy_stats(self) -> dict[str, int]:
        """A few Envoy counters that tell pooled streams from new connections (for the run's notes)."""
        out: dict[str, int] = {}
        e = self.envoys.get("envoy-originator")
        if e is not None:
            with contextlib.suppress(Exception):
                stats = e.stats()
                for k in ("cluster.hbone.upstream_cx_total", "cluster.hbone.upstream_rq_total"):
                    out[k] = stats.get(k, 0)
        return out

    # -- routes --------------------------------------------------------------------------------------------------

    def route(self, mode: str) -> dict[str, Any]:
        if mode in PAIR_MODES:
            if self.pairs is None:
                raise ValueError(f"mode {mode!r} was not selected when the topology was built")
            return dict(self.pairs.route(mode))
        m = self.mesh
        socks = [m.node_a, 15080]
        bind = self.client_ip(mode)
        port = self.server_port()
        if mode == "direct":
            return {"addr": [m.node_b, port], "socks": None, "bind": bind}
        if mode == "tcp":
            return {"addr": socks, "socks": [m.plain, port], "bind": bind}
        if mode == "hbone":
            return {"addr": socks, "socks": [m.node_b, port], "bind": bind}
        if mode == "envoy":
            host, port = self.envoys["envoy-originator"].listener_address(ORIGINATOR_LISTENER)
            return {"addr": [host, port], "socks": None, "bind": bind}
        raise ValueError(f"unknown mode {mode!r}")

    def describe(self) -> dict[str, Any]:
        m = self.mesh
        return {
            "name": self.name,
            "node_a": m.node_a,
            "node_b": m.node_b,
            "plain": m.plain,
            "server": f"{m.node_b} and {m.plain}, port {APP_PORT} + repetition index",
            "client_source_ips": {mode: self.client_ip(mode, 0) + " (+4 per repetition)" for mode in LOOPBACK_MODES},
            "envoy_circuit_breakers": "lifted to 1,000,000 (defaults cap a cluster at 1,024 concurrent requests)",
            "ztunnel_env": {"RUST_LOG": "warn", **self.ztunnel_env},
            "node_pairs": self.pairs.describe() if self.pairs is not None else None,
        }

    def close(self) -> list[LogIssue]:
        issues = self.stop_proxies()
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(5)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
            self.server = None
        if self.pairs is not None:
            issues += self.pairs.close()
            self.pairs = None
        return issues
