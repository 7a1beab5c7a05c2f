"""What an idle tunnel holds, object by object: the objects kept for each tunnel's whole life have no per-instance
dict (slots), and the connection record reads the stream's counters through bound methods, not closures made per
tunnel. Together with the preloaded buffer released (tests/proxy/test_relay.py) this took the Python heap of an idle
tunnel (both sides, tracemalloc) from 12.4 to 9.7 KiB (bench/README.md, "Optimisations")."""

from __future__ import annotations

import asyncio
import ipaddress
import types
from pathlib import Path
from typing import cast

import pytest

from ztunnel.proxy.connection_manager import ConnectionRecord, Direction
from ztunnel.proxy.hbone.core import HboneConnection
from ztunnel.proxy.hbone.stream import HboneStream, StreamConnection
from ztunnel.proxy.relay import PlainConnection
from ztunnel.testing import (
    NODE_A_IP,
    NODE_B_IP,
    SERVER_APP,
    SERVICE_VIP,
    EchoServer,
    TwoNodeMesh,
    node_env,
    running_app,
    socks5_connect,
)


class _Conn:
    core = HboneConnection(True)
    closed = False
    write_paused = False


def _objects() -> list[object]:
    ip = ipaddress.ip_address("10.0.0.1")
    return [
        PlainConnection(),
        HboneStream(cast(StreamConnection, _Conn()), 1),
        ConnectionRecord(Direction.INBOUND, (ip, 1), (ip, 2)),
    ]


@pytest.mark.parametrize("obj", _objects(), ids=lambda o: type(o).__name__)
def test_per_tunnel_objects_have_no_instance_dict(obj: object) -> None:
    assert not hasattr(obj, "__dict__"), f"{type(obj).__name__} instances carry a dict: add __slots__"


async def test_an_open_tunnel_holds_no_closures_or_buffers_for_its_record(tmp_path: Path) -> None:
    """A real tunnel (SOCKS5 -> node A -> HBONE -> node B -> echo), idle after a byte each way: on both nodes the
    connection record reads the stream's byte counters and closes it through bound methods of the stream (no
    closures made per tunnel), and the client's plaintext socket holds no read buffer."""
    echo = await EchoServer().start(*SERVER_APP)
    async with (
        running_app(node_env("node-a", NODE_A_IP, "default/client/client", tmp_path / "ca")) as a,
        running_app(node_env("node-b", NODE_B_IP, "default/server/server", tmp_path / "ca")) as b,
    ):
        reader, writer = await socks5_connect((NODE_A_IP, 15080), *SERVICE_VIP)
        writer.write(b"x")
        assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"
        try:
            for app in (a, b):
                (record,) = list(app.proxy.pi.connections)  # type: ignore[attr-defined]
                stream = record.bytes_sent.__self__
                assert isinstance(stream, HboneStream)
                for method in (record.bytes_sent, record.bytes_recv, record.closer):
                    assert isinstance(method, types.MethodType) and method.__self__ is stream
                assert {record.bytes_sent(), record.bytes_recv()} == {1}
                assert stream.plain is not None and len(stream.plain.buf) == 0  # idle: no read buffer
        finally:
            writer.close()
            await echo.stop()


async def test_tunnels_from_one_peer_share_their_derived_source(tmp_path: Path) -> None:
    """Two tunnels from the same workload, open at once: on both nodes their records hold the same DerivedWorkload
    object (one per identity, and on node B per baggage value and identity), not one built per connection (a frozen
    dataclass of 8 fields, then compared field by field in the label cache)."""
    mesh = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*mesh.server_app)
    writers: list[asyncio.StreamWriter] = []
    try:
        async with running_app(mesh.env_a()) as a, running_app(mesh.env_b()) as b:
            for _ in range(2):
                reader, writer = await mesh.socks5()
                writers.append(writer)
                writer.write(b"x")
                assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"
            for app in (a, b):
                records = list(app.proxy.pi.connections)  # type: ignore[attr-defined]
                assert len(records) == 2
                assert records[0].derived_source is not None
                assert records[0].derived_source is records[1].derived_source
            for w in writers:
                w.close()
            writers.clear()
    finally:
        for w in writers:
            w.close()
        await echo.stop()
