"""The namespaced test topology (ztunnel/testing/netns.py): addressing, pod-to-pod traffic on one node and across
nodes, running code inside a namespace, and cleanup that leaves nothing behind. Root only; skipped otherwise."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ztunnel.testing import netns
from ztunnel.testing.netns import NETNS_DIR, Topology

pytestmark = pytest.mark.root


@pytest.fixture
def topo() -> Iterator[Topology]:
    with netns.topology() as t:
        yield t


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(await reader.read(100))
    await writer.drain()
    writer.close()


async def _roundtrip(src: netns.Netns, host: str, port: int, data: bytes = b"ping") -> tuple[bytes, str]:
    r, w = await src.open_connection(host, port)
    try:
        w.write(data)
        return await asyncio.wait_for(r.read(100), 5), w.get_extra_info("sockname")[0]
    finally:
        w.close()


def test_addressing(topo: Topology) -> None:
    a = topo.pod("node1", "a")
    b = topo.pod("node2", "b")
    c = topo.pod("node1", "c")
    assert (a.node.ip, b.node.ip) == ("172.172.0.2", "172.172.0.3")
    assert (a.ip, c.ip, b.ip) == ("10.0.2.2", "10.0.2.3", "10.0.3.2")
    assert topo.resolve("c") == "10.0.2.3"
    assert topo.node("node1") is a.node
    assert "inet 10.0.2.2/32" in a.exec(["ip", "-o", "addr", "show", "eth0"]).stdout
    assert "inet 172.172.0.3/16" in b.node.exec(["ip", "-o", "addr", "show", "eth0"]).stdout
    with pytest.raises(ValueError, match="already exists"):
        topo.pod("node2", "a")
    with pytest.raises(KeyError, match="no pod 'zz'"):
        topo.resolve("zz")


async def test_pod_to_pod_same_and_cross_node(topo: Topology) -> None:
    a = topo.pod("node1", "a")
    same = topo.pod("node1", "same")
    remote = topo.pod("node2", "remote")
    servers = [await p.start_server(_echo, "0.0.0.0", 8080) for p in (same, remote, a)]
    try:
        for dst in (same, remote):
            data, src_ip = await _roundtrip(a, dst.ip, 8080)
            assert (data, src_ip) == (b"ping", a.ip)  # no NAT anywhere: the peer sees the pod's own IP
        data, _ = await _roundtrip(remote, a.ip, 8080)  # and back the other way
        assert data == b"ping"
    finally:
        for s in servers:
            s.close()


async def test_node_namespaces_reach_pods_and_each_other(topo: Topology) -> None:
    a = topo.pod("node1", "a")
    b = topo.pod("node2", "b")
    server = await b.start_server(_echo, "0.0.0.0", 9000)
    try:
        assert (await _roundtrip(a.node, b.ip, 9000))[0] == b"ping"  # node1 -> pod on node2
        assert (await _roundtrip(b.node, b.ip, 9000))[0] == b"ping"  # node2 -> its own pod
    finally:
        server.close()
    node_server = await b.node.start_server(_echo, b.node.ip, 9001)
    try:
        assert (await _roundtrip(a, b.node.ip, 9001))[0] == b"ping"  # pod -> other node's IP
    finally:
        node_server.close()


def test_run_and_exec_inside(topo: Topology) -> None:
    a = topo.pod("node1", "a")
    host_ns = os.stat("/proc/thread-self/ns/net").st_ino
    assert a.run(lambda: os.stat("/proc/thread-self/ns/net").st_ino) == a.inode != host_ns
    assert os.stat("/proc/thread-self/ns/net").st_ino == host_ns  # this thread never moved
    assert a.exec(["cat", "/proc/sys/net/ipv4/ip_forward"]).stdout.strip() == "0"
    assert a.node.exec(["cat", "/proc/sys/net/ipv4/ip_forward"]).stdout.strip() == "1"
    with pytest.raises(netns.NetnsSetupError, match=rf"in netns {a.name} failed \(exit 1\)"):
        a.exec(["false"])
    p = a.popen(["ip", "-o", "addr", "show", "eth0"], stdout=subprocess.PIPE)
    assert a.ip.encode() in p.communicate(timeout=5)[0]


async def test_loop_thread_creates_sockets_in_the_namespace(topo: Topology) -> None:
    a = topo.pod("node1", "a")
    b = topo.pod("node2", "b")
    lt = topo.loop_thread(b)

    async def serve() -> asyncio.Server:
        # Binding the pod's own address only works inside the pod's namespace.
        return await asyncio.start_server(_echo, b.ip, 0)

    async def close(server: asyncio.Server) -> None:
        server.close()
        await server.wait_closed()

    server = await lt.run(serve())
    try:
        assert (await _roundtrip(a, b.ip, server.sockets[0].getsockname()[1]))[0] == b"ping"
    finally:
        await lt.run(close(server))


def test_close_removes_everything_even_after_a_failure() -> None:
    netns.require()
    names: list[str] = []
    with pytest.raises(RuntimeError, match="test failed"), Topology() as t:
        t.pod("node1", "a")
        t.pod("node2", "b")
        t.loop_thread(t.pods["a"])
        names = t.namespaces
        assert len(names) == 5 and all((NETNS_DIR / n).exists() for n in names)
        raise RuntimeError("test failed")
    # Every veth and the bridge lived inside these namespaces (none in the host's), so they went with them.
    assert not [n for n in names if (NETNS_DIR / n).exists()]
    t.close()  # idempotent


def test_concurrent_topologies_do_not_collide() -> None:
    netns.require()
    with Topology() as t1, Topology() as t2:
        a1, a2 = t1.pod("node1", "a"), t2.pod("node1", "a")
        assert a1.ip == a2.ip and a1.name != a2.name and a1.inode != a2.inode


def test_reap_stale_removes_namespaces_of_dead_processes() -> None:
    netns.require()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}-{dead.pid}-abcdef"
    live = f"{netns.PREFIX}-{os.getpid()}-reap{os.urandom(2).hex()}"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", live], check=True)
    try:
        removed = netns.reap_stale()  # (a test process running alongside may have reaped it first)
        assert live not in removed
        assert not Path(NETNS_DIR / stale).exists() and (NETNS_DIR / live).exists()
    finally:
        for n in (stale, live):
            subprocess.run(["ip", "netns", "del", n], capture_output=True, check=False)
