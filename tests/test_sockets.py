"""Options on the sockets ztunnel accepts, read back with getsockopt from the real accepted sockets.

Upstream (``socket.rs::Listener::accept``, ztunnel-facts.md §2): every accepted socket gets TCP_NODELAY; those of the
outbound (15001) and inbound plaintext (15006) listeners also get TCP keepalive, idle 180 s, interval 180 s, 9 probes
(``KEEPALIVE_*``), and no TCP_USER_TIMEOUT unless ``USER_TIMEOUT_ENABLED``.

An in-process ztunnel (dedicated mode, on a loopback address of its own). Connections that stay open (15008, 15080,
15053) are found among this process's descriptors by their addresses. Connections to 15001/15006 cannot stay open
without capture rules (the original destination falls back to the listener itself, a refused self-call), so those
listeners' accept callbacks are wrapped on the running instance to keep a duplicate of the accepted descriptor: the
duplicate is the same kernel socket, whose options the test then reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.sockets import TCP_USER_TIMEOUT, connect
from ztunnel.testing import TwoNodeMesh, hbone_dial, running_app


def options(sock: socket.socket) -> dict[str, int]:
    tcp = socket.IPPROTO_TCP
    return {
        "nodelay": sock.getsockopt(tcp, socket.TCP_NODELAY),
        "keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        "idle": sock.getsockopt(tcp, socket.TCP_KEEPIDLE),
        "interval": sock.getsockopt(tcp, socket.TCP_KEEPINTVL),
        "count": sock.getsockopt(tcp, socket.TCP_KEEPCNT),
        "user_timeout": sock.getsockopt(tcp, TCP_USER_TIMEOUT),
    }


def accepted_socket(local: tuple[str, int], peer: tuple[str, int]) -> socket.socket:
    """A duplicate of this process's socket whose local address is ``local`` and peer ``peer`` (the accepted side)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.getsockname()[:2] == local and s.getpeername()[:2] == peer:
                return s
        except OSError:
            pass
        s.close()
    raise AssertionError(f"no accepted socket {local} <- {peer} in this process")


@contextlib.contextmanager
def keep_accepted(listener: Any) -> Iterator[list[socket.socket]]:
    """Wrap ``listener._accepted`` on this instance: after ztunnel handled the accept, keep a dup of the socket."""
    kept: list[socket.socket] = []
    original = listener._accepted

    def accepted(plain: Any) -> None:
        sock = plain.transport.get_extra_info("socket")
        original(plain)
        kept.append(socket.socket(fileno=os.dup(sock.fileno())))

    listener._accepted = accepted
    try:
        yield kept
    finally:
        del listener._accepted
        for s in kept:
            s.close()


@pytest.fixture
def mesh(tmp_path: Path) -> TwoNodeMesh:
    return TwoNodeMesh(tmp_path)


@pytest.fixture
async def node(mesh: TwoNodeMesh) -> AsyncIterator[Any]:
    async with running_app(mesh.env_a()) as app:
        yield app


async def connect_and_keep(listener: Any, addr: tuple[str, int]) -> dict[str, int]:
    with keep_accepted(listener) as kept:
        _reader, writer = await asyncio.open_connection(*addr)
        for _ in range(200):
            if kept:
                break
            await asyncio.sleep(0.01)
        assert len(kept) == 1
        got = options(kept[0])
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return got


UPSTREAM_KEEPALIVE = {"nodelay": 1, "keepalive": 1, "idle": 180, "interval": 180, "count": 9, "user_timeout": 0}


@pytest.mark.parametrize("port", [15001, 15006])
async def test_outbound_and_plaintext_inbound_get_nodelay_and_keepalive(
    node: Any, mesh: TwoNodeMesh, port: int
) -> None:
    listener = node.proxy.outbound if port == 15001 else node.proxy.inbound_passthrough
    assert await connect_and_keep(listener, (mesh.node_a, port)) == UPSTREAM_KEEPALIVE


async def test_keepalive_settings_from_environment(mesh: TwoNodeMesh) -> None:
    env = mesh.env_a(KEEPALIVE_TIME="30s", KEEPALIVE_INTERVAL="10s", KEEPALIVE_RETRIES="3", USER_TIMEOUT_ENABLED="true")
    async with running_app(env) as app:
        got = await connect_and_keep(app.proxy.outbound, (mesh.node_a, 15001))  # type: ignore[attr-defined]
    # TCP_USER_TIMEOUT = time + retries * interval, so keepalive and the user timeout give up together.
    assert got == {"nodelay": 1, "keepalive": 1, "idle": 30, "interval": 10, "count": 3, "user_timeout": 60_000}


async def test_keepalive_disabled(mesh: TwoNodeMesh) -> None:
    async with running_app(mesh.env_a(KEEPALIVE_ENABLED="false")) as app:
        got = await connect_and_keep(app.proxy.inbound_passthrough, (mesh.node_a, 15006))  # type: ignore[attr-defined]
    assert (got["nodelay"], got["keepalive"], got["user_timeout"]) == (1, 0, 0)


async def test_hbone_inbound_gets_nodelay(node: Any, mesh: TwoNodeMesh) -> None:
    ca = LocalCA.load_or_create(mesh.ca_dir, "cluster.local")
    conn = await hbone_dial(
        (mesh.node_a, 15008), ca.issue(Identity("cluster.local", "default", "x"), timedelta(hours=1))
    )
    assert isinstance(conn, HboneTransport) and conn.transport is not None
    client = conn.transport.get_extra_info("sockname")[:2]
    with accepted_socket((mesh.node_a, 15008), client) as s:
        got = options(s)
    conn.close("test done")
    assert got["nodelay"] == 1
    assert got["keepalive"] == 0  # upstream keeps TCP keepalive to the 15001/15006 accepts


async def find_accepted(local: tuple[str, int], peer: tuple[str, int]) -> socket.socket:
    for _ in range(100):  # the accept runs on the loop shortly after our connect completed
        with contextlib.suppress(AssertionError):
            return accepted_socket(local, peer)
        await asyncio.sleep(0.01)
    return accepted_socket(local, peer)


@pytest.mark.parametrize("port", [15080, 15053])
async def test_socks5_and_dns_tcp_get_nodelay(node: Any, mesh: TwoNodeMesh, port: int) -> None:
    _reader, writer = await asyncio.open_connection(mesh.node_a, port)
    with await find_accepted((mesh.node_a, port), writer.get_extra_info("sockname")[:2]) as s:
        got = options(s)
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    assert (got["nodelay"], got["keepalive"]) == (1, 0)


def test_options_helper_reads_a_plain_socket() -> None:
    # The helper itself: a fresh TCP socket has neither option, so the assertions above are not vacuous.
    with socket.socket() as s:
        assert options(s)["nodelay"] == 0 and options(s)["keepalive"] == 0


# -- connect(): numeric addresses without uvloop's getaddrinfo round trip -------------------------------------------


async def test_connect_reaches_a_listener_and_reports_refusal_as_connect_does() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    addr = server.sockets[0].getsockname()
    try:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await connect(sock, addr)
            assert sock.getpeername() == addr
        finally:
            sock.close()
    finally:
        server.close()
        await server.wait_closed()
    refused = socket.socket()
    refused.setblocking(False)
    try:
        with pytest.raises(ConnectionRefusedError, match="Connection refused"):
            await connect(refused, addr)  # the listener is gone
    finally:
        refused.close()


async def test_connect_waits_for_the_handshake_and_can_be_cancelled() -> None:
    # A listener whose backlog is full leaves a SYN unanswered: the connect stays pending (it must not return before
    # the handshake) until the caller's timeout cancels it.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    addr = listener.getsockname()
    held: list[socket.socket] = []
    pending = socket.socket()
    pending.setblocking(False)
    try:
        for _ in range(4):  # fill the accept queue (backlog 0 still admits one or two)
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(addr)
            held.append(s)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await connect(pending, addr)
    finally:
        for s in held:
            s.close()
        pending.close()
        listener.close()
    await asyncio.sleep(0.05)  # the loop goes on polling after the close


async def test_peer_and_local_addresses_are_parsed_once_per_address() -> None:
    """``transport_peer``/``transport_local`` answer from the addresses the transport kept and a cache of parsed
    addresses (the same few come back on every connection): the same object each time, still canonical (an
    IPv4-mapped IPv6 peer is its IPv4 address)."""
    import ipaddress

    from ztunnel.sockets import transport_local, transport_peer

    transports: list[asyncio.BaseTransport] = []

    class Keep(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            transports.append(transport)

    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET6) as listener:
        listener.bind(("::", 0))
        listener.listen()
        server = await loop.create_server(Keep, sock=listener)
        clients = [socket.create_connection(("127.0.0.1", listener.getsockname()[1])) for _ in range(2)]
        try:
            for _ in range(200):
                if len(transports) == 2:
                    break
                await asyncio.sleep(0.01)
            (ip1, port1), (ip2, port2) = (transport_peer(t) for t in transports)
            assert ip1 == ipaddress.IPv4Address("127.0.0.1") and ip1 is ip2  # parsed once, canonical
            assert {port1, port2} == {c.getsockname()[1] for c in clients}
            assert transport_local(transports[0])[0] is transport_local(transports[1])[0]
            assert transport_local(transports[0])[1] == listener.getsockname()[1]
        finally:
            for c in clients:
                c.close()
            for t in transports:
                t.close()
            server.close()


def test_packed_ipv4_addresses_are_made_once() -> None:
    """SOCKS5 requests and iptables' original destinations name the same few addresses on every connection."""
    from ztunnel.sockets import ipv4_from_packed

    first = ipv4_from_packed(bytes([10, 0, 0, 7]))
    assert str(first) == "10.0.0.7"
    assert ipv4_from_packed(bytes([10, 0, 0, 7])) is first
