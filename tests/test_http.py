"""The admin/stats/readiness HTTP servers: what they cannot parse is answered as upstream's hyper does, and they are
bounded (head timeout, idle timeout, connection cap) so that no client can hold ztunnel's descriptors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.robustness import Tunnel, close_tunnels, fd_count, open_tunnels, pid_of, raise_nofile, settle, two_nodes
from ztunnel.config import SocketAddress
from ztunnel.http import HttpLimits, HttpServer, default_max_connections
from ztunnel.readiness import Readiness, ReadinessServer
from ztunnel.testing import EchoServer, TwoNodeMesh, running_app


async def test_garbage_gets_http11_400() -> None:
    """Upstream's ``malicious_calls_inpod`` sends ``hello world\\r\\n\\r\\n`` to 15020/15021 and expects
    ``HTTP/1.1 400`` back (hyper); aiohttp's own answer would start ``HTTP/1.0 400``."""
    server = ReadinessServer(Readiness())
    await server.start(SocketAddress("127.0.0.1", 0))
    try:
        assert server.address is not None
        reader, writer = await asyncio.open_connection(*server.address)
        writer.write(b"hello world\r\n\r\n")
        head = await asyncio.wait_for(reader.readline(), 5)
        assert head.startswith(b"HTTP/1.1 400 "), head
        assert await asyncio.wait_for(reader.read(), 5)  # the rest, then the server closes
        writer.close()
    finally:
        await server.stop()


# -- bounds: head timeout, idle timeout, connection cap (real sockets) -------------------------------------------

GENEROUS = 20.0  # seconds: "eventually", never a performance threshold
HEAD = b"GET /ok HTTP/1.1\r\nHost: x\r\nUser-Agent: test\r\n\r\n"


@contextlib.asynccontextmanager
async def serving(limits: HttpLimits) -> AsyncIterator[HttpServer]:
    from aiohttp import web

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/ok", ok)
    server = HttpServer(app, limits, name="test")
    await server.start(SocketAddress("127.0.0.1", 0))
    try:
        yield server
    finally:
        await server.stop()


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Read until the server closes (EOF or reset); True if it did within GENEROUS seconds."""
    try:
        async with asyncio.timeout(GENEROUS):
            while await reader.read(4096):
                pass
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return True


async def until_no_connections(server: HttpServer) -> None:
    async with asyncio.timeout(GENEROUS):
        while server.open_connections:
            await asyncio.sleep(0.01)


async def get(addr: tuple[str, int], path: bytes = b"/ok") -> bytes:
    """One ``GET path`` with ``Connection: close``; the whole response."""
    reader, writer = await asyncio.open_connection(*addr)
    writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    body = await asyncio.wait_for(reader.read(), GENEROUS)
    writer.close()
    return body


async def test_half_sent_heads_are_closed() -> None:
    async with serving(HttpLimits(head_timeout=0.2, idle_timeout=60, max_connections=1000)) as server:
        assert server.address is not None
        conns = [await asyncio.open_connection(*server.address) for _ in range(100)]
        for i, (_, writer) in enumerate(conns):
            writer.write(HEAD[: 10 + i % 20])  # never the blank line
        results = await asyncio.gather(*(closed_by_server(r) for r, _ in conns))
        assert all(results), results.count(False)
        for _, writer in conns:
            writer.close()
        assert server.timed_out == 100
        await until_no_connections(server)
        assert (await get(server.address)).endswith(b"ok\n")  # and it still serves


async def test_silent_connection_is_closed() -> None:
    async with serving(HttpLimits(head_timeout=0.2, idle_timeout=60, max_connections=10)) as server:
        assert server.address is not None
        reader, writer = await asyncio.open_connection(*server.address)
        assert await closed_by_server(reader)
        writer.close()


async def test_slowloris_is_closed_at_the_head_deadline_not_per_byte() -> None:
    """One byte every 50 ms keeps the connection busy forever if each byte restarted the timer; the deadline is
    absolute, so the server closes it before the head is complete."""
    head = b"GET /ok HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 400 + b"\r\n\r\n"
    async with serving(HttpLimits(head_timeout=0.5, idle_timeout=0.5, max_connections=10)) as server:
        assert server.address is not None
        reader, writer = await asyncio.open_connection(*server.address)
        sent = 0
        try:
            for byte in head:
                writer.write(bytes([byte]))
                await writer.drain()
                sent += 1
                await asyncio.sleep(0.05)
                if reader.at_eof() or writer.is_closing():
                    break
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(1), 0.001) == b"":
                        break
        except ConnectionError:
            pass
        writer.close()
        assert sent < len(head), "the head was completed: the dribble was never cut"
        assert server.timed_out == 1


async def test_idle_keepalive_connection_is_closed_and_kept_alive_before() -> None:
    async with serving(HttpLimits(head_timeout=60, idle_timeout=1.0, max_connections=10)) as server:
        assert server.address is not None
        reader, writer = await asyncio.open_connection(*server.address)
        for _ in range(3):  # keep-alive: several requests on one connection, back to back
            writer.write(HEAD)
            status = await asyncio.wait_for(reader.readline(), GENEROUS)
            assert status.startswith(b"HTTP/1.1 200"), status
            while (await reader.readline()) != b"\r\n":
                pass
            assert await reader.readexactly(3) == b"ok\n"
        assert await closed_by_server(reader)  # then idle: closed
        writer.close()
        assert server.timed_out == 1


async def test_connection_cap_holds_and_serving_resumes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ztunnel.http")
    async with serving(HttpLimits(head_timeout=60, idle_timeout=60, max_connections=5)) as server:
        assert server.address is not None
        held = [await asyncio.open_connection(*server.address) for _ in range(5)]
        for _, writer in held:
            writer.write(b"GET /ok HTTP/1.1\r\n")  # half-sent, held open
        await asyncio.sleep(0.05)
        assert server.open_connections == 5
        # Over the cap: each further connection is closed as soon as it is accepted, however many arrive.
        extra = [await asyncio.open_connection(*server.address) for _ in range(50)]
        assert all(await asyncio.gather(*(closed_by_server(r) for r, _ in extra)))
        for _, writer in extra:
            writer.close()
        assert server.refused == 50 and server.open_connections == 5
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "5 connections open, the cap" in warnings[0].getMessage()
        # Load drops: normal requests are served again, and the end of the episode is said once.
        for _, writer in held:
            writer.close()
        await until_no_connections(server)
        for _ in range(10):
            assert (await get(server.address)).endswith(b"ok\n")
        infos = [r.getMessage() for r in caplog.records if "accepting connections again" in r.getMessage()]
        assert len(infos) == 1 and "50 were refused at the cap of 5" in infos[0]


def test_default_cap_is_a_sixteenth_of_the_descriptor_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert default_max_connections() == 16
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
        assert default_max_connections() == min(4096, hard) // 16
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_the_three_servers_of_a_running_ztunnel_close_half_sent_heads(tmp_path: Path) -> None:
    """Admin (15000), stats (15020) and readiness (15021) with their default limits (2 s, as upstream): a normal
    probe and scrape work, and half-sent heads are closed."""
    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_a()):
        ports = (15000, 15020, 15021)
        paths = {15000: b"/config_dump", 15020: b"/metrics", 15021: b"/healthz/ready"}
        for port in ports:
            body = await get((m.node_a, port), paths[port])
            assert body.startswith(b"HTTP/1.1 200"), (port, body[:100])
        conns = [await asyncio.open_connection(m.node_a, port) for port in ports for _ in range(5)]
        for _, writer in conns:
            writer.write(b"GET / HTTP/1.1\r\nHost")
        assert all(await asyncio.gather(*(closed_by_server(r) for r, _ in conns)))
        for _, writer in conns:
            writer.close()


async def test_half_sent_requests_cannot_starve_hbone_of_descriptors(tmp_path: Path) -> None:
    """The issue's scenario, on real processes: node B limited to 256 descriptors, 300 half-sent requests to its
    admin, stats and readiness ports held open, and new tunnels through B must still work. Each server holds at most
    a sixteenth of the limit (16); the rest are reset at accept. Before the bounds, the 300 stayed open and B could
    not accept HBONE or connect to the app."""
    raise_nofile(4096)
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    held: list[Tunnel] = []
    try:
        with two_nodes(tmp_path, m) as (_, b):
            pid = pid_of(b)
            await close_tunnels(await open_tunnels(m, 1))  # pooled HBONE connection, certificates, lazy imports
            await settle([pid])
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (256, 256))
            assert fd_count(pid) < 200, fd_count(pid)
            for port in (15000, 15020, 15021):
                for _ in range(100):
                    try:
                        reader, writer = await asyncio.open_connection(m.node_b, port)
                    except OSError:
                        continue
                    writer.write(b"GET /metrics HTTP/1.1\r\nHost")  # never finished
                    held.append((reader, writer))
            assert len(held) == 300
            await asyncio.sleep(0.2)
            # New tunnels through B work while the half-sent requests are still being held by their clients.
            await close_tunnels(await asyncio.wait_for(open_tunnels(m, 10), GENEROUS))
            assert fd_count(pid) < 256 - 48, fd_count(pid)  # the cap holds
            assert b.proc is not None and b.proc.poll() is None
    finally:
        await close_tunnels(held)
        await echo.stop()
    log = (tmp_path / "b.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    for name in ("admin", "stats", "readiness"):
        assert log.count(f"{name} server {m.node_b}:") >= 1, log[-3000:]
