"""ZDS message decoding and the proxy state machine, without sockets or namespaces (upstream statemanager tests)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import pytest

from xds.istio.workload.zds import zds_pb2
from ztunnel.config import WorkloadInfo
from ztunnel.inpod.netns import NetnsId
from ztunnel.inpod.protocol import (
    AddWorkload,
    DelWorkload,
    KeepWorkload,
    SnapshotSent,
    ZdsMessageError,
    decode_request,
    encode_ack,
    encode_hello,
)
from ztunnel.inpod.statemanager import ProtocolError, ProxyStartError, WorkloadProxyManagerState

INFO = WorkloadInfo("pod-a", "default", "sa-a")


def add_bytes(uid: str, info: bool = True) -> bytes:
    req = zds_pb2.WorkloadRequest()
    req.add.uid = uid
    if info:
        req.add.workload_info.name, req.add.workload_info.namespace, req.add.workload_info.service_account = (
            "pod-a",
            "default",
            "sa-a",
        )
    return req.SerializeToString()


def other_bytes(kind: str, uid: str = "") -> bytes:
    req = zds_pb2.WorkloadRequest()
    if kind == "keep":
        req.keep.uid = uid
    elif kind == "del":
        getattr(req, "del").uid = uid
    else:
        req.snapshot_sent.SetInParent()
    return req.SerializeToString()


def fd() -> int:
    r, w = os.pipe()
    os.close(w)
    return r


def is_open(n: int) -> bool:
    try:
        os.fstat(n)
    except OSError:
        return False
    return True


def test_hello_and_ack_bytes() -> None:
    assert zds_pb2.ZdsHello.FromString(encode_hello()).version == zds_pb2.V1
    assert encode_hello() == bytes([0x08, 0x01])  # field 1 varint 1
    resp = zds_pb2.WorkloadResponse.FromString(encode_ack("boom"))
    assert resp.WhichOneof("payload") == "ack" and resp.ack.error == "boom"
    assert zds_pb2.WorkloadResponse.FromString(encode_ack()).ack.error == ""


def test_decode_each_message() -> None:
    f = fd()
    msg = decode_request(add_bytes("uid-1"), [f], 0)
    assert msg == AddWorkload("uid-1", INFO, f)
    os.close(f)
    assert decode_request(other_bytes("keep", "u"), [], 0) == KeepWorkload("u")
    assert decode_request(other_bytes("del", "u"), [], 0) == DelWorkload("u")
    assert decode_request(other_bytes("snap"), [], 0) == SnapshotSent()


@pytest.mark.parametrize(
    ("data", "nfds", "flags", "error"),
    [
        (add_bytes("u"), 0, 0, "No control message"),
        (add_bytes("u"), 2, 0, "exactly one fd"),
        (other_bytes("del", "u"), 1, 0, "Unexpected control message"),
        (b"", 0, 0, "no payload"),
        (b"\xff\xff\xff", 0, 0, "invalid WorkloadRequest"),
        (add_bytes("u"), 1, socket.MSG_TRUNC, "truncated"),
        (add_bytes("u"), 1, socket.MSG_CTRUNC, "truncated"),
    ],
)
def test_decode_errors_close_every_fd(data: bytes, nfds: int, flags: int, error: str) -> None:
    fds = [fd() for _ in range(nfds)]
    with pytest.raises(ZdsMessageError, match=error):
        decode_request(data, fds, flags)
    assert not any(is_open(f) for f in fds)


# -- the state machine --------------------------------------------------------------------------------------------


@dataclass
class FakeNetns:
    fd: int
    id: NetnsId
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        os.close(self.fd)


@dataclass
class Running:
    netns_id: NetnsId
    stops: list[bool] = field(default_factory=list)

    async def stop(self, immediate: bool) -> None:
        self.stops.append(immediate)


@dataclass
class Factory:
    """Records starts; fails for uids listed in ``failing`` (a port in use, say)."""

    failing: set[str] = field(default_factory=set)
    started: dict[str, Running] = field(default_factory=dict)

    async def start(self, uid: str, info: WorkloadInfo, netns: FakeNetns) -> Running:
        if uid in self.failing:
            raise OSError("address already in use")
        r = Running(netns.id)
        self.started[uid] = r
        return r


def netns_opener() -> tuple[dict[int, int], object]:
    """fd -> namespace inode; the opener maps a received fd to a FakeNetns with that identity."""
    inodes: dict[int, int] = {}

    def opener(f: int) -> FakeNetns:
        return FakeNetns(f, NetnsId(1, inodes[f]))

    return inodes, opener


def new_state(factory: Factory) -> tuple[WorkloadProxyManagerState, dict[int, int]]:
    inodes, opener = netns_opener()
    return WorkloadProxyManagerState(factory, opener), inodes  # type: ignore[arg-type]


def add(inodes: dict[int, int], uid: str, inode: int, info: WorkloadInfo | None = INFO) -> AddWorkload:
    f = fd()
    inodes[f] = inode
    return AddWorkload(uid, info, f)


async def test_snapshot_then_ready() -> None:
    factory = Factory()
    st, inodes = new_state(factory)
    ready_before = st.ready
    await st.process(add(inodes, "a", 100))
    await st.process(SnapshotSent())
    assert not ready_before
    assert st.ready and set(st.pods) == {"a"} and st.started == 1


async def test_add_is_idempotent_for_the_same_netns() -> None:
    factory = Factory()
    st, inodes = new_state(factory)
    await st.process(add(inodes, "a", 100))
    first = factory.started["a"]
    msg = add(inodes, "a", 100)
    await st.process(msg)
    assert factory.started["a"] is first and st.started == 1
    assert not is_open(msg.netns_fd)  # the duplicate fd was closed


async def test_add_with_another_netns_replaces_the_proxy() -> None:
    factory = Factory()
    st, inodes = new_state(factory)
    await st.process(add(inodes, "a", 100))
    first = factory.started["a"]
    await st.process(SnapshotSent())
    await st.process(add(inodes, "a", 200))
    assert first.stops == [True]  # drained immediately
    assert factory.started["a"] is not first and factory.started["a"].netns_id.inode == 200


async def test_reconcile_drops_pods_missing_from_the_snapshot() -> None:
    factory = Factory()
    st, inodes = new_state(factory)
    await st.process(add(inodes, "a", 100))
    await st.process(add(inodes, "b", 101))
    await st.process(SnapshotSent())
    # The agent reconnects: a new snapshot lists only "a" (as keep) and a new pod "c".
    st.reset_snapshot()
    await st.process(KeepWorkload("a"))
    await st.process(add(inodes, "c", 102))
    await st.process(SnapshotSent())
    assert set(st.pods) == {"a", "c"}
    assert factory.started["b"].stops == [True]
    assert factory.started["a"].stops == []


async def test_del_drains_immediately_and_before_snapshot_only_forgets() -> None:
    factory = Factory()
    st, inodes = new_state(factory)
    await st.process(add(inodes, "a", 100))
    await st.process(DelWorkload("a"))  # before the snapshot: bookkeeping only
    assert "a" not in st.snapshot_names and factory.started["a"].stops == []
    await st.process(SnapshotSent())  # "a" was not kept: reconciled away
    assert factory.started["a"].stops == [True]
    await st.process(add(inodes, "b", 101))
    await st.process(DelWorkload("b"))
    assert factory.started["b"].stops == [True] and "b" not in st.pods


async def test_protocol_errors() -> None:
    st, inodes = new_state(Factory())
    with pytest.raises(ProtocolError, match="workload_info is required"):
        await st.process(add(inodes, "a", 1, info=None))
    await st.process(SnapshotSent())
    with pytest.raises(ProtocolError, match="pod keep received after snapshot"):
        await st.process(KeepWorkload("a"))
    with pytest.raises(ProtocolError, match="pod snapshot received already"):
        await st.process(SnapshotSent())


async def test_failed_start_is_pending_and_retried() -> None:
    factory = Factory(failing={"a"})
    st, inodes = new_state(factory)
    with pytest.raises(ProxyStartError, match="address already in use"):
        await st.process(add(inodes, "a", 100))
    await st.process(SnapshotSent())
    assert "a" in st.pending and not st.ready  # readiness waits for pending proxies
    factory.failing.clear()
    await st.retry_pending()
    assert "a" in st.pods and not st.pending and st.ready


async def test_drain_stops_everything_gracefully() -> None:
    factory = Factory()
    st, inodes = new_state(factory)
    await st.process(add(inodes, "a", 100))
    await st.process(add(inodes, "b", 101))
    await st.drain()
    assert factory.started["a"].stops == [False] and factory.started["b"].stops == [False]
    assert st.pods == {}
