"""HTTP/2 PING keepalive of an HBONE connection (``connection.py``: PING_INTERVAL / PING_TIMEOUT, ``_on_ping_timer``),
and the PING of a server's two-step drain GOAWAY.

Upstream (ztunnel-facts.md §3.4): both roles send a PING every 10 s; no answer within 20 s drops the connection with
an abrupt GOAWAY NO_ERROR. The constants are shortened here (0.1 s / 0.3 s). The peer is either another
:class:`HboneTransport` or a raw TLS + HTTP/2 peer built with hyperframe, which sees every frame ztunnel sends and
can answer PINGs or ignore them. Real sockets and TLS on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from hyperframe.frame import Frame, GoAwayFrame, PingFrame, SettingsFrame

from ztunnel import tls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone import connection
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import DRAIN_PING
from ztunnel.proxy.hbone.reason import CloseKind
from ztunnel.testing import hbone_transport

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
INTERVAL = 0.1
TIMEOUT = 0.3


@pytest.fixture(autouse=True)
def short_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "PING_INTERVAL", INTERVAL)
    monkeypatch.setattr(connection, "PING_TIMEOUT", TIMEOUT)


@pytest.fixture
def cert(tmp_path: Path) -> WorkloadCertificate:
    ca = LocalCA.load_or_create(tmp_path / "ca", "cluster.local")
    return ca.issue(Identity("cluster.local", "default", "w"), timedelta(hours=1))


@dataclass
class RawPeer:
    """The far end of a TLS connection, speaking HTTP/2 frame by frame."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    answer_pings: bool
    pings: list[tuple[float, bytes]] = field(default_factory=list)  # (when, opaque data) of PINGs received
    ping_acks: list[bytes] = field(default_factory=list)
    goaways: list[GoAwayFrame] = field(default_factory=list)
    closed_at: float | None = None

    def send(self, frame: Frame) -> None:
        self.writer.write(frame.serialize())

    async def run(self) -> None:
        """Read frames until the connection ends; answer SETTINGS, and PINGs when ``answer_pings``."""
        try:
            while True:
                header = await self.reader.readexactly(9)
                frame, length = Frame.parse_frame_header(memoryview(header))
                frame.parse_body(memoryview(await self.reader.readexactly(length)))
                if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                    self.send(SettingsFrame(0, flags=["ACK"]))
                elif isinstance(frame, PingFrame) and "ACK" in frame.flags:
                    self.ping_acks.append(frame.opaque_data)
                elif isinstance(frame, PingFrame):
                    self.pings.append((time.monotonic(), frame.opaque_data))
                    if self.answer_pings:
                        self.send(PingFrame(0, opaque_data=frame.opaque_data, flags=["ACK"]))
                elif isinstance(frame, GoAwayFrame):
                    self.goaways.append(frame)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        self.closed_at = time.monotonic()


@dataclass
class Pair:
    ours: HboneTransport
    peer: RawPeer
    handshake_at: float


@contextlib.asynccontextmanager
async def raw_pair(cert: WorkloadCertificate, ztunnel_role: str, answer_pings: bool) -> AsyncIterator[Pair]:
    """Our HboneTransport in ``ztunnel_role`` ("server" or "client") connected to a RawPeer."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[HboneTransport] = loop.create_future()
    peer_ready: asyncio.Future[RawPeer] = loop.create_future()
    tasks: list[asyncio.Task[None]] = []
    if ztunnel_role == "server":
        server = await loop.create_server(
            lambda: hbone_transport(False, tls.server_context(cert), done), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=tls.client_context(cert), server_hostname=""
        )
        peer = RawPeer(reader, writer, answer_pings)
        writer.write(PREFACE)
        peer.send(SettingsFrame(0))
        peer_ready.set_result(peer)
    else:

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert await reader.readexactly(len(PREFACE)) == PREFACE
            p = RawPeer(reader, writer, answer_pings)
            p.send(SettingsFrame(0))
            peer_ready.set_result(p)
            await p.run()

        server = await asyncio.start_server(accept, "127.0.0.1", 0, ssl=tls.server_context(cert))
        port = server.sockets[0].getsockname()[1]
        await loop.create_connection(lambda: hbone_transport(True, tls.client_context(cert), done), "127.0.0.1", port)
    ours = await asyncio.wait_for(done, 10)
    handshake_at = time.monotonic()
    peer = await asyncio.wait_for(peer_ready, 10)
    if ztunnel_role == "server":
        tasks.append(asyncio.ensure_future(peer.run()))  # noqa: TID251 - test-owned, awaited below
    try:
        yield Pair(ours, peer, handshake_at)
    finally:
        ours.abort("test done")
        peer.writer.close()
        for t in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 5)
        server.close()
        await server.wait_closed()


async def until(cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("role", ["server", "client"])
async def test_idle_connection_is_pinged_and_stays_open_while_pings_are_answered(
    cert: WorkloadCertificate, role: str
) -> None:
    async with raw_pair(cert, role, answer_pings=True) as pair:
        await asyncio.sleep(3 * TIMEOUT)  # idle: no streams, no data, three timeouts long
        peer = pair.peer
        # A PING every interval (not one outstanding forever): each was answered, so the next one went out.
        assert len(peer.pings) >= 4, peer.pings
        assert peer.pings[0][0] - pair.handshake_at >= INTERVAL * 0.9
        # Not more often than one per interval: counted, not gap by gap (a read the loop delays under load makes
        # one gap long and the next short, however regular the sender's timer is).
        elapsed = time.monotonic() - pair.handshake_at
        assert len(peer.pings) <= elapsed / (INTERVAL * 0.9), (elapsed, [t for t, *_ in peer.pings])
        assert not pair.ours.closed, pair.ours.close_reason
        assert peer.goaways == [] and peer.closed_at is None
        # ztunnel answers the peer's PINGs too, echoing the opaque data.
        peer.send(PingFrame(0, opaque_data=b"keepaliv"))
        await until(lambda: b"keepaliv" in peer.ping_acks, 2)
        assert not pair.ours.closed


@pytest.mark.parametrize("role", ["server", "client"])
async def test_peer_that_never_acks_is_closed_with_goaway_no_error(cert: WorkloadCertificate, role: str) -> None:
    async with raw_pair(cert, role, answer_pings=False) as pair:
        peer = pair.peer
        await until(lambda: peer.closed_at is not None, 5)
        assert peer.closed_at is not None
        assert pair.ours.closed
        reason = pair.ours.close_reason
        assert reason is not None and reason.kind is CloseKind.KEEPALIVE_TIMEOUT
        assert str(reason) == f"no PING response within {TIMEOUT:g}s"
        # One PING, unanswered; after the timeout (not before), a GOAWAY NO_ERROR and then the connection ends.
        assert len(peer.pings) == 1, peer.pings
        first_ping = peer.pings[0][0]
        assert TIMEOUT * 0.9 <= peer.closed_at - first_ping <= TIMEOUT + 3 * INTERVAL + 0.5
        assert [g.error_code for g in peer.goaways] == [0]


async def test_server_drain_sends_goaway_in_two_steps_and_closes_an_idle_connection_once_answered(
    cert: WorkloadCertificate,
) -> None:
    """The drain's PING (upstream's h2 graceful shutdown): GOAWAY 2^31-1 and a PING, then, once the peer answered
    it, the final GOAWAY naming the last stream the peer opened (none: 0) and, with no stream open, the close."""
    async with raw_pair(cert, "server", answer_pings=True) as pair:
        peer = pair.peer
        pair.ours.goaway()
        await until(lambda: peer.closed_at is not None, 5)
        assert [(g.last_stream_id, g.error_code) for g in peer.goaways] == [(2**31 - 1, 0), (0, 0)]
        assert DRAIN_PING in [data for _, data in peer.pings]
        reason = pair.ours.close_reason
        assert reason is not None and reason.kind is CloseKind.DRAINED


async def test_two_idle_hbone_transports_keep_each_other_alive(cert: WorkloadCertificate) -> None:
    loop = asyncio.get_running_loop()
    server_done: asyncio.Future[HboneTransport] = loop.create_future()
    client_done: asyncio.Future[HboneTransport] = loop.create_future()
    server = await loop.create_server(
        lambda: hbone_transport(False, tls.server_context(cert), server_done), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    await loop.create_connection(
        lambda: hbone_transport(True, tls.client_context(cert), client_done), "127.0.0.1", port
    )
    client, srv = await asyncio.wait_for(client_done, 10), await asyncio.wait_for(server_done, 10)
    await asyncio.sleep(3 * TIMEOUT)
    assert not client.closed, client.close_reason
    assert not srv.closed, srv.close_reason
    client.close("test done")
    await until(lambda: srv.closed, 5)
    server.close()
    await server.wait_closed()
