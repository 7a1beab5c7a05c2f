"""In-pod mode end to end, as upstream's ``tests/namespaced.rs``: real namespaces, veths, a bridge and iptables.

Two nodes, each with a ztunnel process in its node namespace in shared (in-pod) mode, fed by the node agent (our
istio-cni stand-in) over ZDS; the agent applies istio-cni's in-pod rules to each enrolled pod. Unmodified clients
(plain sockets inside a pod's namespace) connect to pod IPs and to a service VIP; the kernel redirects them to the
pod's ztunnel listeners. Root only: skipped with the reason elsewhere (and required in CI).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ztunnel.inpod.nodeagent import PodInfo, ZdsServer
from ztunnel.testing import netns as tn

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
MARKER = b"MARKER-7f3a9c-NEVER-IN-CLEAR"


def echo_with_peer(conn: socket.socket) -> None:
    """The app: first says who it sees as the peer (to check source-IP spoofing), then echoes until EOF."""
    conn.sendall(f"peer={conn.getpeername()[0]}\n".encode())
    while data := conn.recv(65536):
        conn.sendall(data)
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
    topo = topology
    pods = {
        "client": topo.pod("node1", "client"),
        "server-a": topo.pod("node1", "server_a"),
        "server-b": topo.pod("node2", "server_b"),
        "plain": topo.pod("node2", "plain"),
    }
    nodes = {"node1": topo.nodes["node1"], "node2": topo.nodes["node2"]}
    config = tmp_path / "mesh.yaml"
    config.write_text(
        MESH.format(
            client=pods["client"].ip, server_a=pods["server-a"].ip, server_b=pods["server-b"].ip, plain=pods["plain"].ip
        )
    )
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
                "ISTIO_META_DNS_CAPTURE": "false",
                "CONNECTION_TERMINATION_DEADLINE": "2s",
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


def peer_and_body(reply: bytes) -> tuple[str, bytes]:
    head, _, body = reply.partition(b"\n")
    return head.decode().removeprefix("peer="), body


async def test_cross_node_captured_pair(cluster: Cluster) -> None:
    c = cluster
    reply = await asyncio.to_thread(c.call, "client", c.pods["server-b"].ip, 8080, b"hello across nodes")
    peer, body = peer_and_body(reply)
    assert body == b"hello across nodes"
    assert peer == c.pods["client"].ip  # the app sees the real client (IP_TRANSPARENT spoofing in its pod)
    await asyncio.sleep(0.2)
    dest = c.scrape("node2")
    (opened,) = [
        s for s in dest["istio_tcp_connections_opened"] if s.labels["connection_security_policy"] == "mutual_tls"
    ]
    assert opened.labels["reporter"] == "destination"
    assert opened.labels["source_principal"] == "spiffe://cluster.local/ns/default/sa/client"
    assert opened.labels["destination_workload"] == "server"
    recv = [s.value for s in dest["istio_tcp_received_bytes"] if s.labels == opened.labels]
    assert recv == [len(b"hello across nodes")]
    src = c.scrape("node1")
    assert any(
        s.labels["reporter"] == "source" and s.labels["connection_security_policy"] == "mutual_tls"
        for s in src["istio_tcp_connections_opened"]
    )
    inbound = [r for r in c.access("node2") if r["direction"] == "inbound"]
    assert inbound and inbound[-1]["src.identity"] == "spiffe://cluster.local/ns/default/sa/client"
    assert inbound[-1]["dst.addr"] == f"{c.pods['server-b'].ip}:15008"


async def test_same_node_captured_pair(cluster: Cluster) -> None:
    c = cluster
    reply = await asyncio.to_thread(c.call, "client", c.pods["server-a"].ip, 8080, b"same node")
    assert peer_and_body(reply) == (c.pods["client"].ip, b"same node")
    await asyncio.sleep(0.2)
    directions = {
        r["direction"] for r in c.access("node1") if r.get("dst.hbone_addr", "").startswith(c.pods["server-a"].ip)
    }
    assert directions == {"inbound", "outbound"}  # both ends on node1's ztunnel, still HBONE between the pods


async def test_captured_client_to_uncaptured_server(cluster: Cluster) -> None:
    c = cluster
    reply = await asyncio.to_thread(c.call, "client", c.pods["plain"].ip, 8080, b"to a plain server")
    assert peer_and_body(reply)[1] == b"to a plain server"
    await asyncio.sleep(0.2)
    src = c.scrape("node1")
    plain = [
        s
        for s in src["istio_tcp_connections_closed"]
        if s.labels["connection_security_policy"] == "unknown" and s.labels["reporter"] == "source"
    ]
    assert plain and plain[0].labels["destination_workload"] == "unknown"  # a TCP workload: passthrough


async def test_uncaptured_client_to_captured_server(cluster: Cluster) -> None:
    c = cluster
    reply = await asyncio.to_thread(c.call, "plain", c.pods["server-b"].ip, 8080, b"from outside the mesh")
    peer, body = peer_and_body(reply)
    assert body == b"from outside the mesh" and peer == c.pods["plain"].ip
    await asyncio.sleep(0.2)
    dest = c.scrape("node2")
    passthrough = [
        s
        for s in dest["istio_tcp_connections_opened"]
        if s.labels["reporter"] == "destination" and s.labels["connection_security_policy"] == "unknown"
    ]
    assert passthrough  # 15006: plaintext inbound, policy-checked, no identity


async def test_service_vip_load_balanced_across_nodes(cluster: Cluster) -> None:
    c = cluster
    peers: set[str] = set()
    servers: list[str] = []
    for i in range(24):
        reply = await asyncio.to_thread(c.call, "client", *VIP, f"req {i}".encode())
        peer, body = peer_and_body(reply)
        assert body == f"req {i}".encode()
        peers.add(peer)
        servers.append(reply.decode())
    assert peers == {c.pods["client"].ip}
    await asyncio.sleep(0.3)
    hbone_targets = {
        r["dst.hbone_addr"].split(":")[0]
        for r in c.access("node1")
        if r["direction"] == "outbound" and r.get("dst.service") == "echo.default.svc.cluster.local"
    }
    assert hbone_targets == {c.pods["server-a"].ip, c.pods["server-b"].ip}


async def test_no_cleartext_on_the_node_link(cluster: Cluster) -> None:
    c = cluster
    pcap = c.work / "node1.pcap"
    dump = c.nodes["node1"].popen(
        ["tcpdump", "--immediate-mode", "-i", "eth0", "-U", "-s", "0", "-w", str(pcap), "tcp"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    err = b""
    try:
        assert dump.stderr is not None
        ready = await asyncio.to_thread(dump.stderr.readline)  # "listening on eth0 ..." once attached
        assert b"listening on" in ready, ready
        payload = MARKER * 50
        reply = await asyncio.to_thread(c.call, "client", c.pods["server-b"].ip, 8080, payload)
        assert peer_and_body(reply)[1] == payload
        await asyncio.sleep(0.5)  # immediate mode + -U write each packet as it comes; a moment for the last
    finally:
        dump.send_signal(signal.SIGINT)
        err = dump.communicate(timeout=5)[1]
    captured = pcap.read_bytes()
    assert len(captured) > len(payload), err.decode()  # the traffic did cross this link (as TLS)
    assert MARKER not in captured
    assert b"\x16\x03" in captured  # TLS handshake records


async def test_calls_to_ztunnel_ports_are_refused(cluster: Cluster) -> None:
    c = cluster

    def attempt(port: int) -> bytes | str:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
                s.sendall(b"loop?")
                s.shutdown(socket.SHUT_WR)
                return s.recv(100)
        except OSError as e:
            return f"{type(e).__name__}:{e.errno}:{e}"

    for port in (15001, 15006, 15008):
        result = await asyncio.to_thread(c.pods["client"].run, attempt, port)
        # Refused, reset or closed: never relayed anywhere (nothing echoed back).
        assert result == b"" or isinstance(result, str), (port, result)
