"""In-pod mode with two worker processes per ztunnel, in real namespaces with istio-cni's iptables rules (the
cluster of ``test_namespaced``): every worker opens every pod's listeners in the pod's namespace, a ZDS ``del``
has closed them in both before it is acked, captured traffic works whichever worker the kernel hands it to, and a
worker that is killed is replaced by one that serves every current pod. Root only."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import struct
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.inpod.cluster import Cluster, metric_sum, running_cluster, topology
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.testing import children_of, eventually, hbone_dial, hbone_tunnel
from ztunnel.testing import netns as tn

__all__ = ["topology"]  # fixtures

SERVER_A_UID = "Kubernetes//Pod/default/server-a"
POD_PORTS = (15001, 15006, 15008)


@pytest.fixture
async def cluster(topology: tn.Topology, tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(topology, tmp_path, dns=False, extra_env={"ZTUNNEL_WORKER_THREADS": "2"}) as c:
        yield c


def workers(c: Cluster, node: str) -> set[int]:
    return set(children_of(c.ztunnels[node].pid))


def listeners(pod: tn.Netns) -> dict[int, set[int]]:
    """{port: pids of the processes listening on it} inside ``pod``'s namespace (``ss``)."""
    out: dict[int, set[int]] = {}
    for line in pod.exec(["ss", "-Hltnp"]).stdout.splitlines():
        port = int(line.split()[3].rsplit(":", 1)[1])
        out.setdefault(port, set()).update(int(p) for p in re.findall(r"pid=(\d+)", line))
    return out


def pod_listeners(pod: tn.Netns) -> dict[int, set[int]]:
    return {port: pids for port, pids in listeners(pod).items() if port in POD_PORTS}


def admin(c: Cluster, node: str, path: str) -> Any:
    def get() -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:15000{path}", timeout=10) as r:
            return json.loads(r.read())

    return c.nodes[node].run(get)


def ready(c: Cluster, node: str) -> bool:
    def get() -> bool:
        try:
            with urllib.request.urlopen(f"http://{c.nodes[node].ip}:15021/healthz/ready", timeout=5) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    return c.nodes[node].run(get)


async def test_every_worker_has_every_pods_listeners_and_del_closes_them_in_both(cluster: Cluster) -> None:
    c = cluster
    pids = workers(c, "node1")
    assert len(pids) == 2
    for pod in ("client", "server-a"):
        got = await eventually(lambda pod=pod: pod_listeners(c.pods[pod]), 10, until=lambda g: len(g) == 3)  # type: ignore[misc]
        assert got == dict.fromkeys(POD_PORTS, pids), pod
    assert await c.agents["node1"].del_pod(SERVER_A_UID) == ""
    # Acked: by now neither worker listens in the pod any more (read at once, no waiting).
    assert pod_listeners(c.pods["server-a"]) == {}
    assert pod_listeners(c.pods["client"]) == dict.fromkeys(POD_PORTS, pids)  # the other pod is untouched


def call(c: Cluster, i: int) -> tuple[bytes, socket.socket]:
    """A captured connection from the client pod to server-b (the other node) that has echoed one line; open."""
    sock = c.pods["client"].new_socket()
    sock.setblocking(True)
    sock.settimeout(10)
    sock.connect((c.pods["server-b"].ip, 8080))
    msg = b"call %d\n" % i
    sock.sendall(msg)
    got = b""
    while got.count(b"\n") < 2:  # the app's "peer=..." line, then the echo
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got.split(b"\n", 1)[1], sock


async def test_captured_traffic_works_whichever_worker_accepts(cluster: Cluster) -> None:
    c = cluster
    results = await asyncio.gather(*(asyncio.to_thread(call, c, i) for i in range(40)))
    try:
        assert [echoed for echoed, _ in results] == [b"call %d\n" % i for i in range(40)]
        rows = await asyncio.to_thread(admin, c, "node1", "/connections")
        outbound = Counter(r["worker"] for r in rows if r["direction"] == "outbound")
        # iptables hands each connection to the pod's 15001, where the kernel picks a worker's listener by its
        # addresses: both took some (all 40 on one would be a 1 in 2^39 chance), and every one got through.
        assert set(outbound) == {0, 1} and sum(outbound.values()) == 40, outbound
        # The config dump's workloadState has the client pod's connections from both workers.
        dump = await asyncio.to_thread(admin, c, "node1", "/config_dump")
        assert len(dump["workloadState"]["Kubernetes//Pod/default/client"]["connections"]["outbound"]) == 40
    finally:
        for _, sock in results:
            sock.close()


async def test_a_killed_worker_comes_back_with_every_pod(cluster: Cluster) -> None:
    c = cluster
    before = workers(c, "node1")
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    after = await eventually(lambda: workers(c, "node1"), 30, until=lambda w: len(w) == 2 and victim not in w)
    (replacement,) = after - before
    assert await eventually(lambda: ready(c, "node1"), 30)
    for pod in ("client", "server-a"):
        assert pod_listeners(c.pods[pod]) == dict.fromkeys(POD_PORTS, after), pod
    results = await asyncio.gather(*(asyncio.to_thread(call, c, i) for i in range(20)))
    for _, sock in results:
        sock.close()
    assert [echoed for echoed, _ in results] == [b"call %d\n" % i for i in range(20)]
    assert replacement in after


async def test_inbound_hbone_connections_the_kernel_gives_one_worker_are_served_by_both(cluster: Cluster) -> None:
    """The balance in-pod: server-a's 15008 (one listener per worker, in the pod's namespace) gets two long-lived
    HBONE connections from source ports the kernel gives one worker (found by probing: a connection reaching an
    idle ztunnel stays where the kernel put it); the second is handed to the other worker, which serves it with the
    same pod's proxy. The raw HBONE client runs in the "plain" pod (not in the mesh: nothing captures it)."""
    c = cluster
    plain, server = c.pods["plain"], c.pods["server-a"]
    cert = LocalCA.load_or_create(c.work / "ca", "cluster.local").issue(
        Identity("cluster.local", "default", "client"), timedelta(hours=1)
    )
    authority = f"{server.ip}:8080"

    def rows() -> list[dict[str, Any]]:
        return [r for r in admin(c, "node1", "/connections") if r["direction"] == "inbound"]

    async def row_of(port: int) -> dict[str, Any]:
        src = f"{plain.ip}:{port}"
        for _ in range(200):
            found = [r for r in await asyncio.to_thread(rows) if r["src"] == src]
            if found:
                return found[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no inbound row from {src}")

    async def idle() -> None:
        for _ in range(400):
            if not await asyncio.to_thread(rows):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("node1 still has inbound connections")

    async def open_tunnel(port: int) -> tuple[Any, asyncio.StreamReader, asyncio.StreamWriter]:
        conn = await hbone_dial((server.ip, 15008), cert, local_addr=(plain.ip, port))
        status, reader, writer = await hbone_tunnel(conn, authority)
        assert status == 200
        assert (await reader.readline()).startswith(b"peer=")  # the app's greeting
        return conn, reader, writer

    async def scenario() -> tuple[int, dict[str, Any], dict[str, Any], list[bytes]]:
        seen: dict[int, int] = {}
        pair: tuple[int, int, int] | None = None
        for port in random.sample(range(20000, 61000), 40):
            try:
                conn, _, writer = await open_tunnel(port)
            except OSError:
                continue
            worker = int((await row_of(port))["worker"])
            writer.close()
            sock = conn.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # no TIME_WAIT
            conn.abort("probe done")
            await idle()
            if worker in seen:
                pair = (seen[worker], port, worker)
                break
            seen[worker] = port
        assert pair is not None, seen
        p1, p2, x = pair
        first = await open_tunnel(p1)
        row1 = await row_of(p1)
        second = await open_tunnel(p2)
        row2 = await row_of(p2)
        echoed = []
        for conn, reader, writer in (first, second):
            writer.write(b"through pod server-a\n")
            writer.write_eof()
            echoed.append(await asyncio.wait_for(reader.read(), 10))
            writer.close()
            conn.close("done")
        return x, row1, row2, echoed

    before = await asyncio.to_thread(c.scrape, "node1")
    x, row1, row2, echoed = await c.topo.loop_thread(plain, "hbone-client").run(scenario())
    assert echoed == [b"through pod server-a\n"] * 2
    assert (row1["worker"], row2["worker"]) == (x, 1 - x)  # the kernel gave both to x
    assert row1["dstWorkload"] == row2["dstWorkload"] == "server-a"
    after = await asyncio.to_thread(c.scrape, "node1")
    moved = metric_sum(after.get("ztunnel_worker_inbound_handoffs", []), worker=str(x), to=str(1 - x))
    assert moved - metric_sum(before.get("ztunnel_worker_inbound_handoffs", []), worker=str(x), to=str(1 - x)) == 1
