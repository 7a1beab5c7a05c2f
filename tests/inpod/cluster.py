"""The two-node in-pod cluster used by the namespaced tests (see ``test_namespaced``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from ztunnel.standins.cni.server import PodInfo, ZdsServer
from ztunnel.testing import netns as tn
from ztunnel.testing.dns import UpstreamDns

MESH = """
workloads:
- {{uid: "Kubernetes//Pod/default/client", name: client, namespace: default, serviceAccount: client,
   workloadIps: ["{client}"], protocol: HBONE, node: node1, canonicalName: client, workloadName: client}}
- {{uid: "Kubernetes//Pod/default/server-a", name: server-a, namespace: default, serviceAccount: server,
   workloadIps: ["{server_a}"], protocol: HBONE, node: node1, canonicalName: echo, workloadName: server,
   services: {{"default/echo.default.svc.cluster.local": {{80: 8080}}}}}}
- {{uid: "Kubernetes//Pod/default/server-b", name: server-b, namespace: default, serviceAccount: server,
   workloadIps: ["{server_b}"], protocol: HBONE, node: node2, canonicalName: echo, workloadName: server,
   services: {{"default/echo.default.svc.cluster.local": {{80: 8080}}}}}}
- {{uid: "Kubernetes//Pod/default/plain", name: plain, namespace: default, serviceAccount: plain,
   workloadIps: ["{plain}"], protocol: TCP, node: node2}}
services:
- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: ["/10.96.0.10"],
   ports: {{80: 8080}}}}
"""
VIP = ("10.96.0.10", 80)
# The "cluster DNS" of the DNS cluster: in the topology's root namespace, on the bridge, outside every node and pod.
UPSTREAM_DNS_IP = tn.BRIDGE_IP
EXTERNAL_NAME, EXTERNAL_IP = "db.example.org", "198.51.100.7"  # a non-mesh name only the upstream DNS knows
T = TypeVar("T")
MARKER = b"MARKER-7f3a9c-NEVER-IN-CLEAR"


def echo_with_peer(conn: socket.socket) -> None:
    """The app: first says who it sees as the peer (to check source-IP spoofing), then echoes until EOF."""
    try:
        conn.sendall(f"peer={conn.getpeername()[0]}\n".encode())
        while data := conn.recv(65536):
            conn.sendall(data)
    except OSError:
        pass  # the tunnel was torn down (a deleted pod, a drained proxy): nothing to echo to
    finally:
        conn.close()


@dataclass
class Cluster:
    topo: tn.Topology
    work: Path
    pods: dict[str, tn.Pod]
    nodes: dict[str, tn.Node]
    ztunnels: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    agents: dict[str, ZdsServer] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    upstream_dns: UpstreamDns | None = None

    def call(self, pod: str, host: str, port: int, payload: bytes, timeout: float = 10) -> bytes:
        """A plain client inside ``pod``: connect, send, half-close, read to EOF."""

        def run() -> bytes:
            with socket.create_connection((host, port), timeout=timeout) as s:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                out = b""
                while chunk := s.recv(65536):
                    out += chunk
                return out

        return self.pods[pod].run(run)

    def scrape(self, node: str) -> dict[str, list[Any]]:
        def get() -> str:
            with urllib.request.urlopen(f"http://{self.nodes[node].ip}:15020/metrics", timeout=5) as r:
                return str(r.read().decode())

        text = self.nodes[node].run(get)
        out: dict[str, list[Any]] = {}
        for fam in text_string_to_metric_families(text):
            out.setdefault(fam.name, []).extend(fam.samples)
        return out

    def access(self, node: str) -> list[dict[str, Any]]:
        out = []
        for line in self.logs[node].read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("scope") == "access" and rec.get("message") == "connection complete":
                out.append(rec)
        return out


def _servers(topo: tn.Topology, pods: dict[str, tn.Pod]) -> list[socket.socket]:
    """Echo apps on :8080 in server-a, server-b and plain (a thread per connection; the pods' own 'app')."""
    import threading

    listeners = []
    for name in ("server-a", "server-b", "plain"):
        lst = pods[name].listen_tcp("0.0.0.0", 8080)
        lst.setblocking(True)
        listeners.append(lst)

        def serve(sock: socket.socket = lst) -> None:
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return
                threading.Thread(target=echo_with_peer, args=(conn,), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()
    return listeners


@pytest.fixture
def topology() -> Iterator[tn.Topology]:
    tn.require(iptables=True)
    with tn.Topology() as topo:
        yield topo


@pytest.fixture
async def cluster(topology: tn.Topology, tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(topology, tmp_path, dns=False) as c:
        yield c


@pytest.fixture
async def dns_cluster(topology: tn.Topology, tmp_path: Path) -> AsyncIterator[Cluster]:
    """The same cluster with DNS capture on: the agent adds the DNS rules, ztunnel runs a DNS proxy per pod, and
    the nodes' resolv.conf (so ztunnel's, which its DNS proxies forward to) names an upstream DNS server on the
    bridge that knows ``EXTERNAL_NAME``."""
    async with running_dns_cluster(topology, tmp_path) as c:
        yield c


@contextlib.asynccontextmanager
async def running_dns_cluster(
    topology: tn.Topology, tmp_path: Path, extra_env: dict[str, str] | None = None
) -> AsyncIterator[Cluster]:
    """:func:`dns_cluster`'s cluster, with ``extra_env`` in the ztunnels' environment."""
    upstream = UpstreamDns({EXTERNAL_NAME: [EXTERNAL_IP]})
    server = topology.loop_thread(topology.root, "upstream-dns")
    await server.run(upstream.start(UPSTREAM_DNS_IP, 53))
    etc = [Path("/etc/netns") / topology.node(node).name for node in ("node1", "node2")]
    try:
        for d in etc:  # `ip netns exec` bind-mounts these over /etc/resolv.conf for the ztunnels it starts
            d.mkdir(parents=True, exist_ok=True)
            (d / "resolv.conf").write_text(f"nameserver {UPSTREAM_DNS_IP}\noptions timeout:2\n")
        async with running_cluster(topology, tmp_path, dns=True, extra_env=extra_env) as c:
            c.upstream_dns = upstream
            yield c
    finally:
        for d in etc:
            with contextlib.suppress(FileNotFoundError):
                (d / "resolv.conf").unlink()
                d.rmdir()
        await server.run(upstream.stop())


@contextlib.asynccontextmanager
async def running_cluster(
    topo: tn.Topology,
    tmp_path: Path,
    dns: bool,
    extra_env: dict[str, str] | None = None,
    *,
    node_env: dict[str, dict[str, str]] | None = None,
    mesh_edit: Callable[[str, dict[str, str]], str] | None = None,
) -> AsyncIterator[Cluster]:
    """The cluster with its two ztunnels (``extra_env``: more of their environment; ``node_env``: more of one node's;
    ``mesh_edit``: rewrites the mesh config's YAML, given each node's IP)."""
    pods = {
        "client": topo.pod("node1", "client"),
        "server-a": topo.pod("node1", "server_a"),
        "server-b": topo.pod("node2", "server_b"),
        "plain": topo.pod("node2", "plain"),
    }
    nodes = {"node1": topo.nodes["node1"], "node2": topo.nodes["node2"]}
    config = tmp_path / "mesh.yaml"
    mesh = MESH.format(
        client=pods["client"].ip, server_a=pods["server-a"].ip, server_b=pods["server-b"].ip, plain=pods["plain"].ip
    )
    if mesh_edit is not None:
        mesh = mesh_edit(mesh, {name: str(node.ip) for name, node in nodes.items()})
    config.write_text(mesh)
    c = Cluster(topo, tmp_path, pods, nodes)
    listeners = _servers(topo, pods)
    enrolled = {"node1": ["client", "server-a"], "node2": ["server-b"]}  # "plain" stays out of the mesh
    try:
        for node, names in enrolled.items():
            agent = ZdsServer(
                str(tmp_path / f"{node}.sock"),
                [
                    PodInfo(
                        f"Kubernetes//Pod/default/{n}",
                        "default",
                        n,
                        "client" if n == "client" else "server",
                        str(pods[n].path),
                    )
                    for n in names
                ],
                apply_rules=True,
                dns_capture=dns,
            )
            await agent.start()
            c.agents[node] = agent
            c.logs[node] = tmp_path / f"{node}.log"
            env = {
                "PATH": os.environ["PATH"],
                "XDS_ADDRESS": "",
                "FAKE_CA": "true",
                "ZTUNNEL_CA_DIR": str(tmp_path / "ca"),
                "LOCAL_XDS_PATH": str(config),
                "NODE_NAME": node,
                "INPOD_UDS": str(tmp_path / f"{node}.sock"),
                "LOG_FORMAT": "json",
                "ISTIO_META_DNS_CAPTURE": "true" if dns else "false",
                "CONNECTION_TERMINATION_DEADLINE": "2s",
                **(extra_env or {}),
                **(node_env or {}).get(node, {}),
            }
            with open(c.logs[node], "wb") as log:  # noqa: ASYNC230 - set-up, before any traffic
                c.ztunnels[node] = nodes[node].popen(
                    [sys.executable, "-m", "ztunnel", "proxy", "ztunnel"], env=env, stdout=log, stderr=log
                )
        for agent in c.agents.values():
            await agent.wait_snapshot(timeout=20)
        await asyncio.sleep(0.3)  # proxies started (the snapshot acks come after each start)
        yield c
    finally:
        for p in c.ztunnels.values():
            p.send_signal(signal.SIGTERM)
        for p in c.ztunnels.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        for agent in c.agents.values():
            await agent.stop()
        for lst in listeners:
            lst.close()


def metric_sum(samples: list[Any], **labels: str) -> float:
    """The sum of the samples whose labels include ``labels`` (upstream's ``query_sum``)."""
    return float(sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items())))


async def eventually(check: Callable[[], T], timeout: float = 5.0) -> T:
    """``check()``'s result once it stops raising AssertionError (metrics and access records land a moment after
    the client saw EOF: the server side closes last); its last error after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await asyncio.to_thread(check)
        except AssertionError:
            if asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(0.05)


def peer_and_body(reply: bytes) -> tuple[str, bytes]:
    head, _, body = reply.partition(b"\n")
    return head.decode().removeprefix("peer="), body
