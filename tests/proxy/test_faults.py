"""Faults on the data path: the peer ztunnel or the backend dies in the middle of a stream.

Real ztunnel processes (:class:`~ztunnel.testing.ZtunnelProcess`) on a random block of loopback
(:class:`~ztunnel.testing.TwoNodeMesh`): a client streams through node A's SOCKS5 listener, A carries it over a pooled
HBONE connection to node B, B delivers it to the app. Then something is killed with SIGKILL, which is what a crash,
an OOM kill or a node going away looks like from the other end: the kernel closes the dead process's sockets (FIN,
or RST when it had unread data).

What the client sees follows RFC 9113 §8.5 and this project's relay (``ztunnel/proxy/relay.py``): an error on the
HBONE connection or stream reaches the client as a TCP reset, a clean end as a FIN. Upstream's ``copy.rs`` is more
lenient: its ``ignore_io_errors`` turns a reset or an unexpected EOF into a clean shutdown, so an upstream client
sees a FIN in both cases.

The sockets A holds towards B's HBONE port are read from ``/proc/net/tcp`` (the tests run in their own network
namespace under ``make test`` as root, and on random loopback addresses otherwise, so only A's sockets match).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from ztunnel.identity.manager import SecretManager
from ztunnel.identity.spiffe import Identity
from ztunnel.testing import EchoServer, TwoNodeMesh, ZtunnelProcess, running_app

pytestmark = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <_io.FileIO name='[^']*\.log':pytest.PytestUnraisableExceptionWarning"
)

CLIENT = Identity("cluster.local", "default", "client")
# /proc/net/tcp states (include/net/tcp_states.h).
ESTABLISHED, CLOSE_WAIT = "01", "08"
CHUNK = 64 * 1024


def _hexaddr(ip: str, port: int) -> str:
    return f"{int.from_bytes(socket.inet_aton(ip), 'little'):08X}:{port:04X}"


def sockets_to(local_ip: str, remote: tuple[str, int]) -> dict[int, str]:
    """TCP sockets from ``local_ip`` to ``remote`` in this network namespace: local port -> state (hex)."""
    local, far = _hexaddr(local_ip, 0)[:8], _hexaddr(*remote)
    out: dict[int, str] = {}
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[1].startswith(local) and fields[2] == far:
                out[int(fields[1].split(":")[1], 16)] = fields[3]
    return out


def live_hbone(m: TwoNodeMesh) -> set[int]:
    """Local ports of node A's HBONE connections to node B that A has not closed (established or half-closed)."""
    return {p for p, st in sockets_to(m.node_a, (m.node_b, 15008)).items() if st in (ESTABLISHED, CLOSE_WAIT)}


async def until(predicate: object, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


def access_lines(log: Path, *needles: str) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if "connection complete" in ln and all(n in ln for n in needles)]


async def start(env: dict[str, str], log: Path) -> ZtunnelProcess:
    return await asyncio.to_thread(ZtunnelProcess(env, log).start)


def kill(node: ZtunnelProcess) -> None:
    assert node.proc is not None
    node.proc.send_signal(signal.SIGKILL)
    node.proc.wait(5)


async def echo_round(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    assert await asyncio.wait_for(reader.readexactly(len(data)), 5) == data


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[TwoNodeMesh]:
    m = TwoNodeMesh(tmp_path)
    nodes: list[ZtunnelProcess] = []
    m.nodes = nodes  # type: ignore[attr-defined]
    try:
        yield m
    finally:
        for node in nodes:
            if node.proc is not None:
                await asyncio.to_thread(node.stop)


# -- the peer ztunnel dies ---------------------------------------------------------------------------------------


async def test_peer_ztunnel_killed_mid_stream(mesh: TwoNodeMesh, tmp_path: Path) -> None:
    m = mesh
    nodes: list[ZtunnelProcess] = m.nodes  # type: ignore[attr-defined]
    echo = await EchoServer().start(*m.server_app)
    try:
        b = await start(m.env_b(), tmp_path / "b.log")
        nodes.append(b)
        a = await start(m.env_a(), tmp_path / "a.log")
        nodes.append(a)
        a_log = tmp_path / "a.log"

        # A tunnel streaming through A -> B on one pooled HBONE connection.
        reader, writer = await m.socks5()
        port = writer.get_extra_info("sockname")[1]
        payload = os.urandom(CHUNK)
        for _ in range(16):
            await echo_round(reader, writer, payload)
        (before,) = live_hbone(m)

        # B is killed while the client keeps streaming: the client sees a reset, not a clean end.
        kill(b)

        async def stream_until_broken() -> BaseException:
            try:
                while True:
                    writer.write(payload)
                    await writer.drain()
                    if not await reader.read(CHUNK):
                        return AssertionError("clean EOF: the client was told the tunnel ended normally")
            except (ConnectionError, OSError) as e:
                return e

        err = await asyncio.wait_for(stream_until_broken(), 10)
        writer.close()
        assert isinstance(err, ConnectionResetError), f"expected a reset, got {err!r}"

        # A's access log records the failure of that connection (error level, with the reason).
        await until(lambda: access_lines(a_log, f":{port} ", "error="), 5, "A's access line for the broken tunnel")
        (line,) = access_lines(a_log, f":{port} ")
        assert 'direction="outbound"' in line and "HBONE connection lost" in line, line

        # A closed its end of the dead connection and dropped it from the pool.
        await until(lambda: not live_hbone(m), 5, "A closing its HBONE connection to the dead B")

        # B stays down: the next request dials (refused) and the client gets SOCKS5 "connection refused".
        with pytest.raises(ConnectionError, match="SOCKS5 reply 5"):
            await asyncio.wait_for(m.socks5(), 10)
        await until(lambda: access_lines(a_log, "Connection refused"), 5, "A's access line for the refused dial")
        (line,) = access_lines(a_log, "Connection refused")
        assert f'error="failed to connect to {m.node_b}:15008: Connection refused"' in line, line

        # B comes back on the same addresses: the next request dials a new connection, and it works.
        nodes.append(await start(m.env_b(), tmp_path / "b2.log"))
        reader, writer = await m.socks5()
        for _ in range(4):
            await echo_round(reader, writer, payload)
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        (after,) = live_hbone(m)
        assert after != before
    finally:
        await echo.stop()


# -- the backend dies --------------------------------------------------------------------------------------------

# The app behind node B, as its own process so it can be SIGKILLed: "send" writes a counter stream and never reads,
# "hold" accepts and never reads (what the client sends stays unread in its socket). Prints "listening" when bound.
BACKEND = textwrap.dedent(
    """
    import socket, sys
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen()
    print("listening", flush=True)
    conn, _ = srv.accept()
    if mode == "send":
        i = 0
        while True:
            conn.sendall(b"".join(b"%08d" % (i + k) for k in range(1024)))
            i += 1024
    else:
        while True:
            socket.socket().close()  # idle without reading
            import time; time.sleep(1)
    """
)


def counter_stream(n: int) -> bytes:
    """The first ``n`` bytes the "send" backend writes."""
    return b"".join(b"%08d" % i for i in range(n // 8 + 1))[:n]


class Backend:
    def __init__(self, mode: str, addr: tuple[str, int]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BACKEND, mode, addr[0], str(addr[1])], stdout=subprocess.PIPE
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"listening\n"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(5)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def unread_at(addr: tuple[str, int]) -> int:
    """Bytes waiting unread in the receive queue of the accepted socket(s) at ``addr``."""
    local = _hexaddr(*addr)
    total = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[1] == local and fields[3] == ESTABLISHED:
                total += int(fields[4].split(":")[1], 16)
    return total


async def test_backend_killed_mid_stream(mesh: TwoNodeMesh, tmp_path: Path) -> None:
    m = mesh
    nodes: list[ZtunnelProcess] = m.nodes  # type: ignore[attr-defined]
    nodes.append(await start(m.env_b(), tmp_path / "b.log"))
    # One worker on A: the test follows one pooled HBONE connection (each worker process has a pool of its own).
    nodes.append(await start(m.env_a(ZTUNNEL_WORKER_THREADS="1"), tmp_path / "a.log"))
    echo_addr = (m.node_b, 9090)
    echo = await EchoServer().start(*echo_addr)
    backend = (m.node_b, 8080)
    stop = asyncio.Event()

    # Three echo tunnels to the same workload keep streaming through the whole test, on the same pooled HBONE
    # connection as the tunnels whose backend dies (same source, destination and identities: one pool key).
    async def bystander(seed: int) -> tuple[bytes, bytes]:
        reader, writer = await m.socks5(*echo_addr)
        sent, got = bytearray(), bytearray()
        i = 0
        try:
            while not stop.is_set() or i < 8:
                data = bytes([seed, i % 256]) * (CHUNK // 2)
                writer.write(data)
                got += await asyncio.wait_for(reader.readexactly(len(data)), 5)
                sent += data
                i += 1
                await asyncio.sleep(0.01)
            writer.write_eof()
            got += await asyncio.wait_for(reader.read(), 5)
        except (ConnectionError, OSError, RuntimeError, asyncio.IncompleteReadError) as e:
            raise AssertionError(f"bystander tunnel {seed} broke after {len(got)} bytes: {e!r}") from e
        finally:
            writer.close()
        return bytes(sent), bytes(got)

    bystanders = [asyncio.ensure_future(bystander(s)) for s in range(3)]  # noqa: TID251 - awaited below
    try:
        await until(lambda: echo.received >= 3 * CHUNK, 5, "the bystander tunnels streaming")
        (pooled,) = live_hbone(m)

        # A backend that streams to the client dies: its kernel closes the socket with a FIN, which B carries as
        # END_STREAM and A as a FIN. The client sees a clean end after an intact prefix of the stream.
        sender = Backend("send", backend)
        reader, writer = await m.socks5(*backend)
        received = await asyncio.wait_for(reader.readexactly(1 << 20), 5)
        sender.kill()
        rest = await asyncio.wait_for(reader.read(), 5)
        while rest:
            received += rest
            rest = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert received == counter_stream(len(received))

        # A backend with unread data from the client dies: its kernel answers with a RST, which B carries as
        # RST_STREAM(CONNECT_ERROR) and A as a TCP reset to the client.
        holder = Backend("hold", backend)
        reader, writer = await m.socks5(*backend)
        writer.write(b"unread" * 1000)
        await until(lambda: unread_at(backend) >= 6000, 5, "the client's bytes waiting in the backend's socket")
        holder.kill()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), 5)
        writer.close()

        # The bystanders never noticed: every byte echoed intact, on the same HBONE connection as before.
        stop.set()
        for sent, got in await asyncio.gather(*bystanders):
            assert got == sent and len(sent) >= 8 * CHUNK
        assert live_hbone(m) == {pooled}
        assert len(access_lines(tmp_path / "a.log", f"dst.hbone_addr={m.node_b}:9090 ", "error=")) == 0

        # Each end logged what happened: B the backend's FIN (info) and reset (error), A the stream's end and reset.
        to_backend = f"dst.hbone_addr={m.node_b}:8080 "
        await until(lambda: len(access_lines(tmp_path / "b.log", to_backend)) == 2, 5, "B's access lines")
        fin, rst = access_lines(tmp_path / "b.log", to_backend)
        assert "\tinfo\t" in fin and "error=" not in fin, fin
        assert "\terror\t" in rst and 'error="connection reset: ' in rst, rst
        await until(lambda: len(access_lines(tmp_path / "a.log", to_backend)) == 2, 5, "A's access lines")
        fin, rst = access_lines(tmp_path / "a.log", to_backend)
        assert "error=" not in fin and 'error="stream reset by peer (HTTP/2 error 10)"' in rst, rst
    finally:
        stop.set()
        for t in bystanders:
            t.cancel()
        await asyncio.gather(*bystanders, return_exceptions=True)
        await echo.stop()


# -- the wall clock jumps past a certificate's expiry ------------------------------------------------------------


class FailingCa:
    async def fetch_certificate(self, identity: object) -> Any:
        raise RuntimeError("CA unreachable")


def access_errors(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    """The ``error`` field of the access-log records (``connection complete`` / ``connection failed``) so far."""
    errors = [getattr(r, "fields", {}).get("error") for r in caplog.records if r.name == "access"]
    return [e for e in errors if isinstance(e, str) and needle in e]


def peer_serials(app: Any) -> set[int]:
    """Serial numbers of the client certificates presented on the HBONE connections open at ``app``'s inbound."""
    serials = set()
    for conn in app.proxy.inbound.connections:
        if conn.ssl_object is not None and (der := conn.ssl_object.getpeercert(binary_form=True)):
            serials.add(x509.load_der_x509_certificate(der).serial_number)
    return serials


async def test_clock_jump_past_certificate_expiry(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In process, so each node's SecretManager clock can be moved: certificates of 10 minutes, then the wall clock
    jumps 11 minutes. The next connection renews before presenting anything; when renewal fails, the handshake fails
    with the reason in the log instead of presenting the expired certificate."""
    caplog.set_level(logging.INFO)
    m = TwoNodeMesh(tmp_path)
    # One stream per HBONE connection, idle ones closed after 100 ms: every tunnel below is a new TLS handshake.
    short = {"SECRET_TTL": "10m", "POOL_MAX_STREAMS_PER_CONNECTION": "1", "POOL_UNUSED_RELEASE_TIMEOUT": "100ms"}
    echo = await EchoServer().start(*m.server_app)
    writers: list[asyncio.StreamWriter] = []
    try:
        async with running_app(m.env_a(**short)) as a, running_app(m.env_b(**short)) as b:
            certs_a: SecretManager = a.certs  # type: ignore[attr-defined]
            certs_b: SecretManager = b.certs  # type: ignore[attr-defined]
            held_reader, held_writer = await m.socks5()
            writers.append(held_writer)
            await echo_round(held_reader, held_writer, b"before")
            (old_serial,) = peer_serials(b)

            # Eleven minutes later by the wall clock, for node A (its monotonic refresh, 5 minutes away, has not
            # fired). The CA now signs for 24 hours, so the renewed certificate is valid at either time.
            jump = timedelta(minutes=11)
            certs_a.clock = lambda: datetime.now(UTC) + jump
            certs_a.client.ttl = timedelta(hours=24)  # type: ignore[attr-defined]
            reader, writer = await m.socks5()
            writers.append(writer)
            await echo_round(reader, writer, b"after the jump")
            new_serials = peer_serials(b) - {old_serial}
            assert len(new_serials) == 1, "the new connection should present a renewed certificate"
            assert "expired at" in caplog.text and "renewing it before use" in caplog.text
            writer.close()
            # The tunnel established before the jump carries on with the certificate it was made with.
            await echo_round(held_reader, held_writer, b"still here")
            pool = a.proxy.pi.pool  # type: ignore[attr-defined]
            await until(lambda: len(pool) == 1, 5, "A closing the idle HBONE connection")

            # A day later for node A, and its CA is unreachable: nothing valid to present. The connection fails
            # at once with the reason; SOCKS5 says "connection refused".
            ca_a = certs_a.client
            certs_a.clock = lambda: datetime.now(UTC) + timedelta(days=2)
            certs_a.client = FailingCa()
            with pytest.raises(ConnectionError, match="SOCKS5 reply 5"):
                await asyncio.wait_for(m.socks5(), 5)
            await until(lambda: access_errors(caplog, "no certificate"), 5, "A's access line for the refused dial")
            (error,) = access_errors(caplog, "no certificate")
            assert error == f"no certificate for {CLIENT}: CA unreachable", error

            # The same for node B, on the serving side: A's handshake fails, B logs why.
            certs_a.clock = lambda: datetime.now(UTC)
            certs_a.client = ca_a
            certs_a.forget(CLIENT)  # start afresh, rather than wait for the retry backoff
            certs_b.clock = lambda: datetime.now(UTC) + timedelta(days=2)
            certs_b.client = FailingCa()
            with pytest.raises(ConnectionError, match="SOCKS5 reply"):
                await asyncio.wait_for(m.socks5(), 5)
            await until(lambda: access_errors(caplog, "local workload"), 5, "B's line for the refused handshake")
            (error,) = access_errors(caplog, "local workload")
            assert error.startswith("no certificate for the local workload: ") and "CA unreachable" in error, error
            for w in writers:
                w.close()  # before the nodes drain, which would wait for open tunnels
    finally:
        for w in writers:
            w.close()
        await echo.stop()
