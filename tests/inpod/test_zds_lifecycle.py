"""ZDS with a real ztunnel in real namespaces: NACKs, deletes, agent restarts, protocol errors, rolling restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.inpod.cluster import Cluster, cluster, peer_and_body, topology
from xds.istio.workload.zds import zds_pb2
from ztunnel.inpod.nodeagent import PodInfo, ZdsServer
from ztunnel.testing import netns as tn

__all__ = ["cluster", "topology"]  # fixtures

SERVER_B_UID = "Kubernetes//Pod/default/server-b"


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
    node = topology.node("node1")
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
    proc = node.popen([sys.executable, "-m", "ztunnel"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
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
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=5)
        listener.close()


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
        new_records = [line for line in new_log.read_text().splitlines() if '"direction": "outbound"' in line]
        assert new_records, "the new process carried the new connection"
    finally:
        newer.send_signal(signal.SIGTERM)
        try:
            newer.wait(15)
        except subprocess.TimeoutExpired:
            newer.kill()
        c.ztunnels.pop("node1", None)


@pytest.fixture(autouse=True)
def _root_only() -> None:
    tn.require(iptables=True)
