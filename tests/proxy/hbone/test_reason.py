"""Why an HBONE connection closed is a value (``CloseReason``: a kind for code, the message for the logs), not a
string that callers sniff. Real sockets and TLS on loopback for the ends a peer can cause."""

from __future__ import annotations

import asyncio
import errno
from datetime import timedelta

import pytest

from ztunnel import tls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import HboneConnection
from ztunnel.proxy.hbone.reason import CloseKind, CloseReason

TD = "cluster.local"


async def serve_one(handshake_timeout: float = 5.0) -> tuple[asyncio.Server, asyncio.Future[HboneTransport]]:
    """A server HBONE transport for the first connection; the future resolves once it closed."""
    ca = LocalCA.generate(TD)
    ctx = tls.server_context(ca.issue(Identity(TD, "default", "server"), timedelta(hours=1)))
    closed: asyncio.Future[HboneTransport] = asyncio.get_running_loop().create_future()

    def on_closed(t: HboneTransport) -> None:
        if not closed.done():
            closed.set_result(t)

    server = await asyncio.get_running_loop().create_server(
        lambda: HboneTransport(
            HboneConnection(False),
            ctx,
            on_handshake=lambda t: None,
            on_closed=on_closed,
            handshake_timeout=handshake_timeout,
        ),
        "127.0.0.1",
        0,
    )
    return server, closed


async def test_handshake_timeout_is_a_timed_out_tls_failure() -> None:
    server, closed = await serve_one(handshake_timeout=0.05)
    try:
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])  # says nothing
        reason = (await asyncio.wait_for(closed, 5)).close_reason
        writer.close()
    finally:
        server.close()
    assert reason is not None
    assert (reason.kind, reason.tls_failure, reason.timed_out) == (CloseKind.TLS_HANDSHAKE_TIMEOUT, True, True)
    assert str(reason) == "TLS handshake timed out after 0.05s"  # the access log's words, unchanged


async def test_refused_handshake_is_a_tls_failure() -> None:
    server, closed = await serve_one()
    try:
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        writer.write(b"GET / HTTP/1.1\r\n\r\n")  # not a ClientHello
        reason = (await asyncio.wait_for(closed, 5)).close_reason
        writer.close()
    finally:
        server.close()
    assert reason is not None
    assert (reason.kind, reason.tls_failure, reason.timed_out) == (CloseKind.TLS_HANDSHAKE_FAILED, True, False)
    assert str(reason).startswith("TLS handshake failed: ")


async def test_peer_that_leaves_before_the_handshake_is_no_tls_failure() -> None:
    server, closed = await serve_one()
    try:
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        writer.write_eof()
        reason = (await asyncio.wait_for(closed, 5)).close_reason
        writer.close()
    finally:
        server.close()
    assert reason is not None
    assert (reason.kind, reason.tls_failure) == (CloseKind.PEER_CLOSED, False)
    assert str(reason) == "peer closed the connection"


@pytest.mark.parametrize(
    ("exc", "kind", "message", "timed_out"),
    [
        (None, CloseKind.CLOSED, "connection closed", False),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), CloseKind.LOST, None, False),
        (TimeoutError(errno.ETIMEDOUT, "Connection timed out"), CloseKind.LOST, None, True),
    ],
)
def test_socket_loss(exc: OSError | None, kind: CloseKind, message: str | None, timed_out: bool) -> None:
    reason = CloseReason.lost(exc)
    assert (reason.kind, reason.timed_out, reason.tls_failure) == (kind, timed_out, False)
    assert str(reason) == (message or f"connection lost: {exc}")


def test_a_message_that_mentions_tls_is_not_a_tls_failure() -> None:
    """What sniffing got wrong: the kind decides, whatever words the message has."""
    assert not CloseReason.aborted("TLS certificates not yet loaded").tls_failure
    assert not CloseReason(CloseKind.TLS_CLOSE_NOTIFY, "peer sent TLS close_notify").tls_failure


def test_local_reasons_given_as_text_are_aborts() -> None:
    conn = HboneTransport(HboneConnection(True), None, on_handshake=lambda t: None)
    conn.abort("shutting down")
    assert conn.close_reason == CloseReason(CloseKind.ABORTED, "shutting down")
