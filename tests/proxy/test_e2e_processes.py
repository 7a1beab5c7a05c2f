"""Two real ztunnel processes on loopback (``python -m ztunnel``, as deployed): client -> SOCKS5 on node A -> HBONE
-> node B -> echo app. The in-process twins of these tests are in ``test_e2e.py``; here nothing is shared with the
test's interpreter but sockets."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from ztunnel.testing import EchoServer, TwoNodeMesh, ZtunnelProcess, send_and_read_echo


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodeMesh]:
    workdir: Path = tmp_path_factory.mktemp("e2e-processes")
    m = TwoNodeMesh(workdir)
    node_b = ZtunnelProcess(m.env_b(), workdir / "b.log").start()
    try:
        node_a = ZtunnelProcess(m.env_a(), workdir / "a.log").start()
    except BaseException:
        node_b.stop()
        raise
    try:
        yield m
    finally:
        codes = node_a.stop(), node_b.stop()
    assert codes == (0, 0), f"exit codes {codes}; logs in {workdir}"  # clean drain on SIGTERM


def matching(log: Path, needle: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if "connection complete" in line and needle in line]


async def access_lines(log: Path, needle: str, count: int = 1) -> list[str]:
    """Wait (up to 10 s) for ``count`` access-log lines containing ``needle`` in a node's log; return them."""
    for _ in range(500):
        lines = matching(log, needle)
        if len(lines) >= count:
            return lines
        await asyncio.sleep(0.02)
    raise AssertionError(f"{len(matching(log, needle))} < {count} access lines with {needle!r} in {log}")


@pytest.fixture
async def echo(mesh: TwoNodeMesh) -> AsyncIterator[EchoServer]:
    server = await EchoServer().start(*mesh.server_app)
    yield server
    await server.stop()


async def test_64mib_each_way_intact(mesh: TwoNodeMesh, echo: EchoServer) -> None:
    total = 64 << 20
    reader, writer = await mesh.socks5()
    # One random MiB, rotated so every MiB differs.
    echoed = await send_and_read_echo(reader, writer, os.urandom(1 << 20), total >> 20, 60)
    assert echoed.received == total
    assert echoed.got_sha256 == echoed.sent_sha256
    assert echo.received == total
    # It went through HBONE: node A's outbound and node B's inbound access lines count every byte both ways.
    port = writer.get_extra_info("sockname")[1]
    (out,) = await access_lines(mesh.workdir / "a.log", f":{port} ")
    assert 'direction="outbound"' in out and f"dst.addr={mesh.node_b}:15008 " in out  # addresses bare, as upstream
    assert f"bytes_sent={total} bytes_recv={total}" in out
    inbound = await access_lines(mesh.workdir / "b.log", f"bytes_sent={total} bytes_recv={total}")
    assert 'direction="inbound"' in inbound[0]


async def test_200_concurrent_connections_each_echo_their_own_bytes(mesh: TwoNodeMesh, echo: EchoServer) -> None:
    all_open = asyncio.Event()
    opened = 0

    async def one(i: int) -> bytes:
        nonlocal opened
        reader, writer = await mesh.socks5()
        msg = f"connection {i} ".encode() * (1 + i % 50)
        writer.write(msg)
        echoed = await asyncio.wait_for(reader.readexactly(len(msg)), 30)
        opened += 1
        if opened == 200:
            all_open.set()
        await asyncio.wait_for(all_open.wait(), 30)  # all 200 tunnels are open at the same time
        writer.write(b"!")
        writer.write_eof()
        rest = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        return echoed + rest

    results = await asyncio.gather(*(one(i) for i in range(200)))
    assert results == [f"connection {i} ".encode() * (1 + i % 50) + b"!" for i in range(200)]
    assert echo.connections == 200
    await access_lines(mesh.workdir / "b.log", 'direction="inbound"', count=200)
