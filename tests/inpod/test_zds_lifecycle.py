"""ZDS with a real ztunnel in real namespaces: NACKs, deletes, agent restarts, snapshot reconciliation, netns
replacement, readiness on 15021, protocol errors, rolling restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.inpod.cluster import Cluster, cluster, eventually, peer_and_body, topology
from xds.istio.workload.zds import zds_pb2
from ztunnel.standins.cni.server import PodInfo, ZdsServer
from ztunnel.testing import netns as tn

__all__ = ["cluster", "topology"]  # fixtures

SERVER_A_UID = "Kubernetes//Pod/default/server-a"
SERVER_B_UID = "Kubernetes//Pod/default/server-b"
CLIENT_UID = "Kubernetes//Pod/default/client"


def open_conversation(c: Cluster, host: str) -> socket.socket:
    """A long-lived connection from the client pod (blocking socket, usable from the test thread)."""
    sock = c.pods["client"].new_socket()
    sock.setblocking(True)
    sock.settimeout(10)
    sock.connect((host, 8080))
    line = b""
    while not line.endswith(b"\n"):
        line += sock.recv(1)  # the app's "peer=..." greeting
    return sock


def roundtrip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def active_proxies(c: Cluster, node: str) -> float:
    (sample,) = c.scrape(node)["workload_manager_active_proxy_count"]
    return float(sample.value)


def proxy_counts(c: Cluster, node: str) -> tuple[float, float, float]:
    """(active, started, stopped) of the node's workload proxy manager."""
    m = c.scrape(node)
    names = (
        "workload_manager_active_proxy_count",
        "workload_manager_proxies_started",
        "workload_manager_proxies_stopped",
    )
    active, started, stopped = (float(m[name][0].value) for name in names)
    return active, started, stopped


def listening(pod: tn.Netns, ports: tuple[int, ...] = (15001, 15006, 15008)) -> set[int]:
    """Which of ztunnel's pod ports accept a connection inside ``pod`` (on its loopback)."""

    def probe() -> set[int]:
        up = set()
        for port in ports:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                up.add(port)
            except OSError:
                pass
        return up

    return pod.run(probe)


def broken(sock: socket.socket) -> bool:
    """The conversation was torn down: a round trip fails or gets nothing back."""
    try:
        return roundtrip(sock, b"anyone?") == b""
    except OSError:
        return True


@asynccontextmanager
async def hand_driven_ztunnel(
    topology: tn.Topology, tmp_path: Path
) -> AsyncIterator[tuple[socket.socket, subprocess.Popen[bytes]]]:
    """A ztunnel in node1's netns in in-pod mode, and the listening ZDS socket the test drives by hand."""
    path = tmp_path / "zds.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)
    env = {
        "PATH": os.environ["PATH"],
        "XDS_ADDRESS": "",
        "FAKE_CA": "true",
        "ZTUNNEL_CA_DIR": str(tmp_path / "ca"),
        "LOCAL_XDS": "workloads: []",
        "INPOD_UDS": str(path),
        "ISTIO_META_DNS_CAPTURE": "false",
    }
    proc = topology.node("node1").popen(
        [sys.executable, "-m", "ztunnel"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield listener, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.communicate(timeout=5)
        listener.close()


def ready(node: tn.Node) -> tuple[int, str]:
    """GET /healthz/ready on the node's 15021 (upstream readiness): status and body; (0, error) if no answer."""

    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{node.ip}:15021/healthz/ready", timeout=2) as r:
                return int(r.status), str(r.read().decode())
        except urllib.error.HTTPError as e:
            return int(e.code), str(e.read().decode())
        except OSError as e:
            return 0, str(e)

    return node.run(get)


async def test_add_with_a_bad_netns_is_nacked(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    not_a_netns = tmp_path / "not-a-netns"
    not_a_netns.write_text("x")
    c.agents["node2"].apply_rules = False  # the agent would fail to apply rules there before even asking ztunnel
    error = await c.agents["node2"].add_pod(
        PodInfo("Kubernetes//Pod/default/bogus", "default", "bogus", "sa", str(not_a_netns))
    )
    assert "not a namespace" in error or "not a network namespace" in error, error
    assert active_proxies(c, "node2") == 1  # server-b only
    # The connection to the agent is still fine: a good pod afterwards works.
    assert await c.agents["node2"].del_pod("Kubernetes//Pod/default/bogus") == ""


async def test_del_drains_the_pod_at_once(cluster: Cluster) -> None:
    c = cluster
    sock = await asyncio.to_thread(open_conversation, c, c.pods["server-b"].ip)
    assert await asyncio.to_thread(roundtrip, sock, b"before") == b"before"
    assert await c.agents["node2"].del_pod(SERVER_B_UID) == ""
    # The pod is gone: its proxy closed the tunnelled connection (reset or EOF), and no proxy is left.
    try:
        rest = await asyncio.to_thread(roundtrip, sock, b"after")
    except OSError:
        rest = b""
    assert rest == b""
    sock.close()
    assert active_proxies(c, "node2") == 0


async def test_agent_restart_keeps_connections_and_resyncs(cluster: Cluster) -> None:
    c = cluster
    sock = await asyncio.to_thread(open_conversation, c, c.pods["server-b"].ip)
    assert await asyncio.to_thread(roundtrip, sock, b"one") == b"one"
    old = c.agents["node2"]
    await old.stop()  # ztunnel sees EOF, keeps its proxies, reconnects with backoff
    await asyncio.sleep(0.3)
    assert await asyncio.to_thread(roundtrip, sock, b"two") == b"two"
    new = ZdsServer(old.path, [PodInfo(SERVER_B_UID, "default", "server-b", "server", str(c.pods["server-b"].path))])
    await new.start()
    c.agents["node2"] = new
    await new.wait_snapshot(timeout=20)  # the same pod, same netns: an idempotent add
    assert await asyncio.to_thread(roundtrip, sock, b"three") == b"three"
    sock.close()
    reply = await asyncio.to_thread(c.call, "client", c.pods["server-b"].ip, 8080, b"new connection")
    assert peer_and_body(reply)[1] == b"new connection"
    (started,) = c.scrape("node2")["workload_manager_proxies_started"]
    assert started.value == 1  # no restart of the pod's proxy


async def test_protocol_error_exits_1(topology: tn.Topology, tmp_path: Path) -> None:
    """A second SnapshotSent is a protocol error: NACK, then ztunnel exits with status 1 (upstream)."""
    async with hand_driven_ztunnel(topology, tmp_path) as (listener, proc):
        listener.settimeout(20)
        conn, _ = await asyncio.to_thread(listener.accept)
        conn.settimeout(10)
        hello = zds_pb2.ZdsHello.FromString(conn.recv(1024))
        assert hello.version == zds_pb2.V1
        snapshot = zds_pb2.WorkloadRequest()
        snapshot.snapshot_sent.SetInParent()
        conn.send(snapshot.SerializeToString())
        assert zds_pb2.WorkloadResponse.FromString(conn.recv(1024)).ack.error == ""
        conn.send(snapshot.SerializeToString())
        nack = zds_pb2.WorkloadResponse.FromString(conn.recv(1024))
        assert nack.ack.error == "pod snapshot received already"
        code = await asyncio.to_thread(proc.wait, 15)
        assert code == 1
        conn.close()


async def test_rolling_restart_hands_over_the_pod_listeners(cluster: Cluster) -> None:
    """A second ztunnel takes the pod listeners (SO_REUSEPORT) while the first drains: a connection opened before
    survives the drain, and new connections go to the new process."""
    c = cluster
    sock = await asyncio.to_thread(open_conversation, c, c.pods["server-b"].ip)
    old = c.ztunnels["node1"]
    new_log = c.work / "node1-new.log"
    env = dict(os.environ)
    env.update(
        {
            "XDS_ADDRESS": "",
            "FAKE_CA": "true",
            "ZTUNNEL_CA_DIR": str(c.work / "ca"),
            "LOCAL_XDS_PATH": str(c.work / "mesh.yaml"),
            "NODE_NAME": "node1",
            "INPOD_UDS": str(c.work / "node1.sock"),
            "LOG_FORMAT": "json",
            "ISTIO_META_DNS_CAPTURE": "false",
            # Its own admin/stats/readiness ports: the old process still holds the default ones during the drain.
            "ZTUNNEL_ADMIN_ADDR": "127.0.0.1:25000",
            "ZTUNNEL_STATS_ADDR": "[::]:25020",
            "ZTUNNEL_READINESS_ADDR": "[::]:25021",
        }
    )
    snapshots = c.agents["node1"].snapshots
    with open(new_log, "wb") as log:  # noqa: ASYNC230 - set-up
        newer = c.nodes["node1"].popen([sys.executable, "-m", "ztunnel"], env=env, stdout=log, stderr=log)
    try:
        await c.agents["node1"].wait_snapshot(count=snapshots + 1, timeout=20)  # the new ztunnel got the pods
        await asyncio.sleep(0.3)
        old.send_signal(signal.SIGTERM)  # CONNECTION_TERMINATION_DEADLINE is 2 s for the old one
        await asyncio.sleep(0.5)
        assert await asyncio.to_thread(roundtrip, sock, b"still here") == b"still here"
        sock.close()
        assert await asyncio.to_thread(old.wait, 15) == 0
        reply = await asyncio.to_thread(c.call, "client", c.pods["server-b"].ip, 8080, b"to the new one")
        assert peer_and_body(reply)[1] == b"to the new one"

        def new_records() -> list[str]:
            # The access line lands a moment after the client saw the reply (written at the close, by a log thread).
            lines = [line for line in new_log.read_text().splitlines() if '"direction": "outbound"' in line]
            assert lines, "the new process carried the new connection"
            return lines

        await eventually(new_records)
    finally:
        newer.send_signal(signal.SIGTERM)
        try:
            newer.wait(15)
        except subprocess.TimeoutExpired:
            newer.kill()
        c.ztunnels.pop("node1", None)


async def test_reconnect_snapshot_removes_pods_it_does_not_list(cluster: Cluster) -> None:
    """After a reconnect, SnapshotSent reconciles: a pod missing from the new snapshot has its proxies drained at
    once; a pod in it with the same netns keeps its proxies (no restart)."""
    c = cluster
    sock = await asyncio.to_thread(open_conversation, c, c.pods["server-a"].ip)  # same node: via server-a's proxy
    assert await asyncio.to_thread(roundtrip, sock, b"before") == b"before"
    assert proxy_counts(c, "node1") == (2, 2, 0)
    old = c.agents["node1"]
    await old.stop()
    # The new agent knows only the client: server-a went away while ztunnel was not listening.
    client = PodInfo(CLIENT_UID, "default", "client", "client", str(c.pods["client"].path))
    new = ZdsServer(old.path, [client])
    await new.start()
    c.agents["node1"] = new
    await new.wait_snapshot(timeout=20)
    assert proxy_counts(c, "node1") == (1, 2, 1)  # server-a stopped, the client's proxy untouched
    assert await asyncio.to_thread(broken, sock)  # drained at once, not after a grace period
    sock.close()
    assert await asyncio.to_thread(listening, c.pods["server-a"]) == set()
    assert await asyncio.to_thread(listening, c.pods["client"]) == {15001, 15006, 15008}
    reply = await asyncio.to_thread(c.call, "client", c.pods["server-b"].ip, 8080, b"client still works")
    assert peer_and_body(reply)[1] == b"client still works"


async def test_add_with_another_netns_replaces_the_proxies(cluster: Cluster) -> None:
    """An add for a running uid with a different network namespace (the pod's sandbox was recreated): the old
    proxies are drained at once and new ones start in the new namespace."""
    c = cluster
    sock = await asyncio.to_thread(open_conversation, c, c.pods["server-b"].ip)
    assert await asyncio.to_thread(roundtrip, sock, b"before") == b"before"
    sandbox = c.topo.pod("node2", "server_b_new")  # a fresh netns for the same uid
    agent = c.agents["node2"]
    agent.apply_rules = False  # only ztunnel's side matters here
    error = await agent.add_pod(PodInfo(SERVER_B_UID, "default", "server-b", "server", str(sandbox.path)))
    assert error == ""
    assert proxy_counts(c, "node2") == (1, 2, 1)
    assert await asyncio.to_thread(broken, sock)
    sock.close()
    assert await asyncio.to_thread(listening, sandbox) == {15001, 15006, 15008}
    assert await asyncio.to_thread(listening, c.pods["server-b"]) == set()
    # The same netns again is a no-op.
    assert await agent.add_pod(PodInfo(SERVER_B_UID, "default", "server-b", "server", str(sandbox.path))) == ""
    assert proxy_counts(c, "node2") == (1, 2, 1)


async def test_readiness_follows_the_zds_connection(topology: tn.Topology, tmp_path: Path) -> None:
    """Readiness on 15021 (upstream): 500 until the first SnapshotSent is processed, 200 then, 500 again once the
    node agent is gone, 200 after the next snapshot."""
    node = topology.node("node1")
    not_ready = (500, "not ready, pending: workload proxy manager\n")
    snapshot = zds_pb2.WorkloadRequest()
    snapshot.snapshot_sent.SetInParent()

    async def accept_and_sync(listener: socket.socket, send_snapshot: bool) -> socket.socket:
        listener.settimeout(20)
        conn, _ = await asyncio.to_thread(listener.accept)
        conn.settimeout(10)
        assert zds_pb2.ZdsHello.FromString(conn.recv(1024)).version == zds_pb2.V1
        if send_snapshot:
            conn.send(snapshot.SerializeToString())
            assert zds_pb2.WorkloadResponse.FromString(conn.recv(1024)).ack.error == ""
        return conn

    def answers(want: tuple[int, str]) -> None:
        assert ready(node) == want

    async with hand_driven_ztunnel(topology, tmp_path) as (listener, _):
        await eventually(lambda: answers(not_ready), timeout=20)  # serving, but no snapshot yet
        conn = await accept_and_sync(listener, send_snapshot=False)
        await asyncio.sleep(0.2)
        assert ready(node) == not_ready  # connected and greeted: still waiting for the snapshot
        conn.send(snapshot.SerializeToString())
        assert zds_pb2.WorkloadResponse.FromString(conn.recv(1024)).ack.error == ""
        assert ready(node) == (200, "ready\n")  # the ack follows processing: ready already
        conn.close()  # the node agent goes away
        await eventually(lambda: answers(not_ready))
        conn = await accept_and_sync(listener, send_snapshot=True)  # it reconnects, with backoff
        assert ready(node) == (200, "ready\n")
        conn.close()


@pytest.fixture(autouse=True)
def _root_only() -> None:
    tn.require(iptables=True)
