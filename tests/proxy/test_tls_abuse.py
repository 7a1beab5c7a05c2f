"""TLS abuse at a live 15008 and from a bad 15008: stalled handshakes are cut, floods of them do not stop good
connections, garbage is turned away in one log line, and a server that never answers fails the client cleanly.

In-process ztunnels (node A and node B of :class:`~ztunnel.testing.TwoNodeMesh`) with real sockets and real TLS. The
handshake timeout (``HANDSHAKE_TIMEOUT``, 10 s) is read when each connection starts, so tests shorten it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
from pathlib import Path

import pytest

from tests.robustness import client_hello, raise_nofile
from ztunnel.app import App
from ztunnel.net import format_addr
from ztunnel.proxy import Proxy
from ztunnel.proxy.hbone import connection
from ztunnel.testing import EchoServer, TwoNodeMesh, running_app

FLOOD = 2000


def proxy_of(app: object) -> Proxy:
    assert isinstance(app, App) and app.proxy is not None
    return app.proxy


def addr(sock_name: tuple[str, int]) -> str:
    return format_addr(sock_name[0], sock_name[1])


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (FIN or reset)."""
    got = bytearray()
    try:
        while chunk := await reader.read(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return bytes(got)


async def sock_closed(sock: socket.socket) -> None:
    """Returns once the server closed ``sock`` (FIN or reset); it never sends anything to a stalled handshake."""
    loop = asyncio.get_running_loop()
    try:
        while await loop.sock_recv(sock, 65536):
            pass
    except ConnectionResetError:
        pass


def about(caplog: pytest.LogCaptureFixture, peer: str) -> list[logging.LogRecord]:
    """The log records that name ``peer`` (in the message or in the structured fields)."""
    return [r for r in caplog.records if peer in r.getMessage() + str(getattr(r, "fields", ""))]


def text_of(record: logging.LogRecord) -> str:
    return record.getMessage() + " " + str(getattr(record, "fields", ""))


async def wait_for(predicate: object, timeout: float = 10.0) -> None:
    assert callable(predicate)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def echo_through(m: TwoNodeMesh, size: int = 1 << 20) -> None:
    """``size`` random bytes to the echo service via node A's SOCKS5 and HBONE to node B; all must come back."""
    reader, writer = await asyncio.wait_for(m.socks5(), 30)
    payload = os.urandom(size)
    writer.write(payload)
    writer.write_eof()
    back = await asyncio.wait_for(reader.read(-1), 30)
    writer.close()
    assert hashlib.sha256(back).digest() == hashlib.sha256(payload).digest()


@pytest.mark.parametrize("first_flight", ["nothing", "half a ClientHello"])
async def test_stalled_handshake_is_cut_after_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, first_flight: str
) -> None:
    monkeypatch.setattr(connection, "HANDSHAKE_TIMEOUT", 0.5)
    caplog.set_level(logging.INFO)
    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_b()) as b:
        inbound = proxy_of(b).inbound
        reader, writer = await asyncio.open_connection(m.node_b, 15008)
        try:
            peer = addr(writer.get_extra_info("sockname"))
            if first_flight != "nothing":
                hello = client_hello()
                writer.write(hello[: len(hello) // 2])
            loop = asyncio.get_running_loop()
            start = loop.time()
            # Without the timeout nothing ever ends this connection (TCP keepalive would, after half an hour).
            assert await asyncio.wait_for(until_closed(reader), 10) == b""
            assert loop.time() - start >= 0.4  # cut by the timer, not by anything else
        finally:
            writer.close()
        await wait_for(lambda: not inbound.connections)
    lines = about(caplog, peer)
    assert len(lines) == 1, [text_of(r) for r in lines]
    assert "TLS handshake timed out after 0.5s" in text_of(lines[0])
    assert lines[0].exc_info is None


async def test_flood_of_stalled_handshakes_does_not_stop_new_connections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """2,000 connections to 15008 that never finish their handshake (half send nothing, half half a ClientHello):
    a new SOCKS5 -> HBONE tunnel through the flooded node still works, and the flood is cut by the timeout."""
    timeout = 6.0
    monkeypatch.setattr(connection, "HANDSHAKE_TIMEOUT", timeout)
    raise_nofile(2 * FLOOD + 1024)  # both ends of every flood connection live in this process
    m = TwoNodeMesh(tmp_path)
    hello = client_hello()
    echo = await EchoServer().start(*m.server_app)
    flood: list[socket.socket] = []
    try:
        async with running_app(m.env_b()) as b, running_app(m.env_a()) as a:
            inbound = proxy_of(b).inbound
            loop = asyncio.get_running_loop()
            first = loop.time()
            for i in range(FLOOD):
                s = socket.socket()
                s.setblocking(False)
                flood.append(s)
                await loop.sock_connect(s, (m.node_b, 15008))
                if i % 2:
                    s.send(hello[: len(hello) // 2])
                if i % 100 == 99:
                    # Pace to the accept rate: past the listen backlog (128) the kernel drops handshakes and
                    # retries them seconds later, which would spread the flood out instead of stacking it up.
                    await wait_for(lambda n=i: len(inbound.connections) >= n - 100)
            await wait_for(lambda: len(inbound.connections) >= FLOOD)

            await echo_through(m)
            # The flood was all still there while the tunnel was set up (no flood connection had reached its
            # deadline yet), and the tunnel took a new TLS handshake on the flooded listener.
            assert loop.time() < first + timeout, "the flood took longer to set up than the handshake timeout"
            assert len(inbound.connections) == FLOOD + 1
            assert proxy_of(a).pi.pool.dials == 1

            # Every flood connection is closed by node B once its handshake deadline passes.
            await asyncio.wait_for(asyncio.gather(*(sock_closed(s) for s in flood)), timeout + 20)
            await wait_for(lambda: len(inbound.connections) == 1)  # node A's pooled connection
            await echo_through(m)  # and the good connection is unharmed
    finally:
        for s in flood:
            s.close()
        await echo.stop()
    assert not [r for r in caplog.records if r.exc_info], [text_of(r) for r in caplog.records if r.exc_info]


GARBAGE = {
    "plain HTTP": b"GET / HTTP/1.1\r\nHost: ztunnel\r\n\r\n",
    "random bytes": bytes(range(256)) * 4,
    "TLS record of junk": b"\x16\x03\x01\x00\x40" + b"\xee" * 64,
    "SSLv2-style hello": b"\x80\x2e\x01\x00\x02\x00\x15" + b"\x00" * 0x2B,
}


@pytest.mark.parametrize("garbage", list(GARBAGE))
async def test_garbage_instead_of_tls_is_closed_with_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, garbage: str
) -> None:
    monkeypatch.setattr(connection, "HANDSHAKE_TIMEOUT", 60.0)  # so only the garbage itself can end it
    caplog.set_level(logging.DEBUG)
    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_b()) as b:
        reader, writer = await asyncio.open_connection(m.node_b, 15008)
        try:
            peer = addr(writer.get_extra_info("sockname"))
            writer.write(GARBAGE[garbage])
            await asyncio.wait_for(until_closed(reader), 10)  # at once, not at the handshake timeout
        finally:
            writer.close()
        await wait_for(lambda: not proxy_of(b).inbound.connections)
    lines = [r for r in about(caplog, peer) if r.levelno >= logging.WARNING]
    assert len(lines) == 1, [text_of(r) for r in about(caplog, peer)]
    assert "TLS handshake failed" in text_of(lines[0])
    assert not [r for r in caplog.records if r.exc_info], [text_of(r) for r in caplog.records if r.exc_info]
    assert "Traceback" not in caplog.text


async def test_server_that_never_answers_the_client_hello(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Node B's 15008 accepts TCP and never answers: node A's dial times out, every SOCKS5 client waiting on it
    gets a failure reply, and the pool is not poisoned: once a real node B is there, the next request dials it."""
    monkeypatch.setattr(connection, "HANDSHAKE_TIMEOUT", 0.5)
    caplog.set_level(logging.INFO)
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    held: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()  # take the ClientHello, say nothing

    silent = await asyncio.start_server(never_answer, m.node_b, 15008, reuse_address=True)
    try:
        async with running_app(m.env_a()) as a:
            pool = proxy_of(a).pi.pool
            replies = await asyncio.gather(*(socks5_reply(m) for _ in range(3)))
            assert all(r not in (None, 0) for r in replies), replies  # a SOCKS5 failure reply, each of them
            assert len(held) == 1  # the three requests shared one dial
            assert len(pool) == 0 and not pool._dialing and pool.dials == 0
            failures = [r for r in caplog.records if "TLS handshake timed out" in text_of(r)]
            assert len(failures) == 3, [text_of(r) for r in failures]
            assert not [r for r in caplog.records if r.exc_info]

            silent.close()
            for w in held:
                w.close()
            await silent.wait_closed()
            async with running_app(m.env_b()):
                await echo_through(m)
            assert pool.dials == 1
    finally:
        silent.close()
        for w in held:
            w.close()
        await echo.stop()


async def socks5_reply(m: TwoNodeMesh, timeout: float = 10.0) -> int | None:
    """A SOCKS5 CONNECT to the echo service through node A: the reply code, or None if none came in ``timeout``."""
    reader, writer = await asyncio.open_connection(m.node_a, 15080)
    try:
        host, port = m.vip
        writer.write(b"\x05\x01\x00" + b"\x05\x01\x00\x01" + socket.inet_aton(host) + port.to_bytes(2, "big"))
        reply = await asyncio.wait_for(reader.readexactly(2 + 10), timeout)
        return reply[3]
    except TimeoutError:
        return None
    finally:
        writer.close()
