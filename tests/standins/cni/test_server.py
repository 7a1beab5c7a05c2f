"""The CNI side of ZDS (ztunnel/standins/cni/server.py) against a hand-written ztunnel client: snapshots, adds and
deletes with their acks and NACKs, connection failures, restarts; and (root) real netns fds with the rules applied.

The "netns" files sent over ZDS are plain files outside the root test, which is all the server cares about.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import socket
from pathlib import Path

import pytest

from tests.standins.cni.helpers import Ztunnel, ino, pod_info, routing
from xds.istio.workload.zds import zds_pb2
from ztunnel.standins.cni.server import PodInfo, ZdsError, ZdsNotConnected, ZdsServer
from ztunnel.testing import netns
from ztunnel.testing.netns import Topology


def test_pod_spec_parsing() -> None:
    assert PodInfo.parse("u1:default/client/sleep:/run/netns/x") == PodInfo(
        "u1", "default", "client", "sleep", "/run/netns/x"
    )
    assert PodInfo.parse("u1:ns/name:podns").service_account == "default"
    assert PodInfo.parse("u1:ns/name:podns").netns_path == Path("/run/netns/podns")
    for bad in ("u1", "u1:ns/name", "u1:ns:x", ":ns/n:x", "u1:a/b/c/d:x", "u1:ns//sa:x"):
        with pytest.raises(ValueError, match="pod"):
            PodInfo.parse(bad)


@pytest.mark.both_loops
async def test_snapshot_adds_with_netns_fds_keep_for_missing_then_snapshot_sent(
    tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]
) -> None:
    pods = [
        pod_info("a", netns_files["a"]),
        pod_info("b", netns_files["b"]),
        pod_info("gone", tmp_path / "no-such-netns"),
    ]
    async with ZdsServer(tmp_path / "zds.sock", pods) as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        req, fds = await zt.recv()
        assert req.WhichOneof("payload") == "add"
        assert (req.add.uid, req.add.workload_info.name, req.add.workload_info.namespace) == ("a", "pod-a", "default")
        assert req.add.workload_info.service_account == "sa-a"
        assert len(fds) == 1 and ino(fds[0]) == netns_files["a"].stat().st_ino
        assert server.snapshots == 0  # waits for each ack before going on
        await zt.ack()
        assert await zt.expect("add", "b") == [netns_files["b"].stat().st_ino]
        await zt.expect("keep", "gone")
        await zt.expect("snapshot_sent")
        await server.wait_snapshot(1, timeout=5)
        assert server.connected == 1
        kinds = [(e.kind, e.uid, e.error) for e in server.history]
        assert kinds == [("add", "a", ""), ("add", "b", ""), ("keep", "gone", ""), ("snapshot_sent", "", "")]


@pytest.mark.both_loops
async def test_add_and_del_after_snapshot_return_ack_or_nack(
    tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]
) -> None:
    async with ZdsServer(tmp_path / "zds.sock", ack_timeout=2) as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        await zt.expect("snapshot_sent")
        await server.wait_snapshot()

        error, inodes = await asyncio.gather(server.add_pod(pod_info("c", netns_files["c"])), zt.expect("add", "c"))
        assert error == "" and inodes == [netns_files["c"].stat().st_ino]
        assert "c" in server.pods

        error, _ = await asyncio.gather(
            server.add_pod(pod_info("a", netns_files["a"])), zt.expect("add", "a", error="failed to start proxy")
        )
        assert error == "failed to start proxy"  # a NACK goes back to the caller; the connection stays
        assert server.connected == 1

        error, _ = await asyncio.gather(server.del_pod("c"), zt.expect("del", "c"))
        assert error == "" and "c" not in server.pods
        error, _ = await asyncio.gather(server.del_pod("a"), zt.expect("del", "a", error="unknown uid"))
        assert error == "unknown uid"
        assert [(e.kind, e.uid, e.error) for e in server.history[1:]] == [
            ("add", "c", ""),
            ("add", "a", "failed to start proxy"),
            ("del", "c", ""),
            ("del", "a", "unknown uid"),
        ]


async def test_without_ztunnel_add_is_recorded_for_the_next_snapshot(
    tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]
) -> None:
    async with ZdsServer(tmp_path / "zds.sock") as server:
        with pytest.raises(ZdsNotConnected, match="no ztunnel is connected"):
            await server.add_pod(pod_info("a", netns_files["a"]))
        assert await server.del_pod("nothing") == ""  # deletes need no connection
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        await zt.expect("add", "a")
        await zt.expect("snapshot_sent")
        await server.wait_snapshot()


@pytest.mark.both_loops
async def test_adds_go_to_the_newest_connection_and_deletes_to_all(
    tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]
) -> None:
    async with ZdsServer(tmp_path / "zds.sock", [pod_info("a", netns_files["a"])]) as server:
        old, new = Ztunnel(server.path), Ztunnel(server.path)
        clients += [old, new]
        for zt in (old, new):
            await zt.hello()
            await zt.expect("add", "a")
            await zt.expect("snapshot_sent")
        await server.wait_snapshot(2)
        assert server.connected == 2
        error, _ = await asyncio.gather(server.add_pod(pod_info("b", netns_files["b"])), new.expect("add", "b"))
        assert error == ""
        results = await asyncio.gather(server.del_pod("a"), old.expect("del", "a"), new.expect("del", "a", "x"))
        assert results[0] == "x"
        # The old connection got no add: the next thing it sees is the delete it already answered; nothing pending.
        assert [e.connection for e in server.history if e.kind == "add" and e.uid == "b"] == [2]


@pytest.mark.both_loops
async def test_missing_ack_closes_the_connection(
    tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]
) -> None:
    async with ZdsServer(tmp_path / "zds.sock", ack_timeout=0.3) as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        await zt.expect("snapshot_sent")
        await server.wait_snapshot()
        add = server.add_pod(pod_info("a", netns_files["a"]))
        error, received = await asyncio.gather(add, zt.recv(), return_exceptions=True)
        assert not isinstance(received, BaseException)
        for fd in received[1]:
            os.close(fd)
        assert isinstance(error, ZdsError) and "within 0.3 s" in str(error)
        assert await zt.eof()
        await server.wait_disconnected(2)
        with pytest.raises(ZdsNotConnected):
            await server.add_pod(pod_info("b", netns_files["b"]))


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(b"\x08\x00", id="version-0"),
        pytest.param(b"\xff\xff\xff", id="garbage"),
        pytest.param(None, id="silence"),
    ],
)
async def test_bad_or_missing_hello_closes_the_connection(
    tmp_path: Path, first: bytes | None, clients: list[Ztunnel]
) -> None:
    async with ZdsServer(tmp_path / "zds.sock", ack_timeout=0.3) as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        if first is not None:
            await zt.send(first)
        assert await zt.eof()
        await server.wait_disconnected(2)
        assert server.snapshots == 0


async def test_unsolicited_message_and_non_ack_close_the_connection(tmp_path: Path, clients: list[Ztunnel]) -> None:
    async with ZdsServer(tmp_path / "zds.sock") as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        await zt.recv()
        await zt.send(b"\x12\x00")  # a WorkloadResponse with no ack in it (an unknown field only)
        assert await zt.eof()
        zt2 = Ztunnel(server.path)
        clients.append(zt2)
        await zt2.hello()
        await zt2.expect("snapshot_sent")
        await server.wait_snapshot()
        await zt2.ack()  # nobody asked
        assert await zt2.eof()
        await server.wait_disconnected(2)


async def test_fds_sent_by_ztunnel_are_closed(tmp_path: Path, clients: list[Ztunnel]) -> None:
    async with ZdsServer(tmp_path / "zds.sock") as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        r, w = os.pipe()
        try:
            await asyncio.to_thread(
                zt.sock.sendmsg,
                [zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString()],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))],
            )
            await zt.expect("snapshot_sent")
            os.close(r)
            # The server's copy was closed: with no reader left, writing fails.
            with pytest.raises(BrokenPipeError):
                os.write(w, b"x")
        finally:
            os.close(w)


async def test_stop_closes_connections_and_removes_the_socket(tmp_path: Path, clients: list[Ztunnel]) -> None:
    server = await ZdsServer(tmp_path / "sub" / "zds.sock").start()
    zt = Ztunnel(server.path)
    clients.append(zt)
    await zt.hello()
    await zt.expect("snapshot_sent")
    await server.wait_snapshot()
    await server.stop()
    assert await zt.eof()
    assert not server.path.exists()
    # A restarted agent binds the same path again, over a stale socket file if one was left.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
        stale.bind(str(server.path))
    async with ZdsServer(server.path) as again:
        zt2 = Ztunnel(again.path)
        clients.append(zt2)
        await zt2.hello()
        await zt2.expect("snapshot_sent")


@pytest.mark.root
async def test_zds_sends_real_netns_fds(topo: Topology, tmp_path: Path, clients: list[Ztunnel]) -> None:
    pod = topo.pod("node1", "a")
    async with ZdsServer(tmp_path / "zds.sock", [pod_info("a", pod.name)], apply_rules=True, ipv6=False) as server:
        assert routing(pod)[0]  # --apply-rules applied them before announcing the pod
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        req, (fd,) = await zt.recv()
        try:
            assert req.add.uid == "a" and os.fstat(fd).st_ino == pod.inode
            ns_get_nstype = 0xB703  # <linux/nsfs.h>: what ztunnel checks the fd with
            assert fcntl.ioctl(fd, ns_get_nstype) == netns.CLONE_NEWNET
        finally:
            os.close(fd)
        await zt.ack()
        await zt.expect("snapshot_sent")
        error, _ = await asyncio.gather(server.del_pod("a"), zt.expect("del", "a"))
        assert error == ""
        assert routing(pod)[0] == ""  # and removed them after the delete
