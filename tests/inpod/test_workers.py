"""In-pod mode with two worker processes per ztunnel, in real namespaces with istio-cni's iptables rules (the
cluster of ``test_namespaced``): every worker opens every pod's listeners in the pod's namespace, a ZDS ``del``
has closed them in both before it is acked, captured traffic works whichever worker the kernel hands it to, and a
worker that is killed is replaced by one that serves every current pod. Root only."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.inpod.cluster import Cluster, running_cluster, topology
from ztunnel.testing import children_of, eventually
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
