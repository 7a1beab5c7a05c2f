"""Resource bounds of real ztunnel processes: idle tunnels in bounded memory, file-descriptor exhaustion that fails
cleanly and recovers, and one stalled stream on a pooled connection that neither grows memory nor stops the others.

Node A and node B run as separate processes (:func:`tests.robustness.two_nodes`), so RSS, descriptors and CPU time
are each process's own; the echo app and the clients live in the test. ``make robustness`` runs the 10,000-tunnel
version of the first test and prints the numbers (see docs/robustness.md). One sans-IO test bounds what
a long-lived pooled connection remembers about the streams it has carried.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import resource
from pathlib import Path

import hpack
import pytest
from hyperframe.frame import HeadersFrame, RstStreamFrame

from tests import soak
from tests.robustness import (
    Sample,
    Tunnel,
    close_tunnels,
    cpu_seconds,
    data_plane_pid,
    fd_count,
    measure_idle_tunnels,
    open_tunnels,
    raise_nofile,
    settle,
    two_nodes,
)
from ztunnel.app import App
from ztunnel.proxy.hbone import connection
from ztunnel.proxy.hbone.core import ErrorCode
from ztunnel.testing import EchoServer, TwoNodeMesh, running_app

from .hbone.test_core import connected, frames, pump

MiB = 1024 * 1024
KiB_PER_IDLE_TUNNEL = 32  # measured ~7 KiB a side (docs/robustness.md); a relay buffer allocated up front would be 256


async def test_idle_tunnels_fit_in_bounded_memory(tmp_path: Path) -> None:
    """1,000 idle SOCKS5 -> HBONE tunnels: node A holds 1,000 client sockets and streams, node B 1,000 streams and
    app sockets; each process grows by at most ``KiB_PER_IDLE_TUNNEL`` per tunnel, and gives the descriptors back."""
    n = 1000
    result = await measure_idle_tunnels(tmp_path, n)
    for node in ("a", "b"):
        assert result.kib_per_tunnel(node) < KiB_PER_IDLE_TUNNEL, result.report()
        assert result.loaded[node].fds >= result.before[node].fds + n, result.report()
        # Closed tunnels give back their sockets; what stays is the pooled HBONE connections (100 streams each),
        # released after POOL_UNUSED_RELEASE_TIMEOUT.
        assert result.after[node].fds <= result.before[node].fds + n // 100, result.report()


async def attempt(m: TwoNodeMesh) -> list[Tunnel] | Exception:
    """One tunnel, or why it failed; a failure must come quickly (a hang fails the test with TimeoutError)."""
    try:
        return await asyncio.wait_for(open_tunnels(m, 1), 10)
    except RuntimeError as e:
        return e


@pytest.mark.parametrize("node", ["a", "b"])
async def test_fd_exhaustion_fails_cleanly_and_recovers(tmp_path: Path, node: str) -> None:
    """Node A out of descriptors: its SOCKS5 listener cannot accept (libuv accepts and closes the connection);
    node B out of descriptors: it cannot connect to the app (503, a SOCKS5 failure reply). Either way: no crash, no
    traceback, no busy loop while exhausted, a clear log line, and service again once descriptors are freed."""
    raise_nofile(1024)
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    tunnels: list[Tunnel] = []
    try:
        with two_nodes(tmp_path, m) as (a, b):
            target = a if node == "a" else b
            pid = data_plane_pid(target)
            await close_tunnels(await open_tunnels(m, 1))  # the pooled HBONE connection, certificates, lazy imports
            await settle([pid])
            limit = fd_count(pid) + 60
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))

            failure: Exception | None = None
            for _ in range(200):
                got = await attempt(m)
                if isinstance(got, Exception):
                    failure = got
                    break
                tunnels += got
            assert failure is not None, "never ran out of descriptors"
            assert len(tunnels) >= 20, (len(tunnels), failure)

            # Exhausted: clients keep trying; every attempt fails at once, and ztunnel does not spin.
            cpu = cpu_seconds(pid)
            results = []
            for _ in range(20):
                results.append(await attempt(m))
                await asyncio.sleep(0.1)
            spent = cpu_seconds(pid) - cpu
            assert all(isinstance(r, Exception) for r in results), results
            assert spent < 0.5, f"{spent:.2f}s of CPU in ~2s while out of descriptors"
            assert target.proc is not None and target.proc.poll() is None

            # Free the descriptors: new tunnels work again.
            await close_tunnels(tunnels)
            await settle([pid])
            await asyncio.sleep(1.1)  # FdHeadroom confirms recovery at most once a second
            tunnels += await asyncio.wait_for(open_tunnels(m, 5), 10)
            await close_tunnels(tunnels)
    finally:
        await close_tunnels(tunnels)
        await echo.stop()
    log = (tmp_path / f"{node}.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    if node == "a":
        assert log.count("running out of file descriptors") == 1, log[-3000:]
        assert log.count("file descriptors available again") == 1, log[-3000:]
    else:
        assert "Too many open files" in log, log[-3000:]


async def push_until_stalled(writer: asyncio.StreamWriter, sha: hashlib._Hash, limit: int) -> int:
    """Write 1 MiB chunks until the writer stops draining (2 s) or ``limit`` is reached; returns bytes written."""
    block = os.urandom(MiB)
    written = 0
    while written < limit:
        chunk = block[written % 4096 :] + block[: written % 4096]  # distinct chunks, cheaply
        sha.update(chunk)
        writer.write(chunk)
        written += len(chunk)
        try:
            await asyncio.wait_for(writer.drain(), 2)
        except TimeoutError:
            break
    return written


async def echo_transfer(m: TwoNodeMesh, size: int) -> None:
    reader, writer = await m.socks5()
    try:
        sent, got = hashlib.sha256(), hashlib.sha256()

        async def send() -> None:
            block = os.urandom(MiB)
            for _ in range(size // MiB):
                sent.update(block)
                writer.write(block)
                await writer.drain()
            writer.write_eof()

        async def recv() -> None:
            while data := await reader.read(1 << 20):
                got.update(data)

        await asyncio.wait_for(asyncio.gather(send(), recv()), 60)
        assert sent.hexdigest() == got.hexdigest()
    finally:
        writer.close()


async def test_stalled_stream_on_a_pooled_connection(tmp_path: Path) -> None:
    """A client sends through the echo service and never reads: what both ztunnels hold stays bounded (the stream
    window, not what is offered), the other streams of the same pooled HBONE connection carry 16 MiB each way intact
    meanwhile, and when the client finally reads, every byte comes back."""
    limit = 256 * MiB
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    try:
        with two_nodes(tmp_path, m) as (a, b):
            pids = {"a": data_plane_pid(a), "b": data_plane_pid(b)}
            await close_tunnels(await open_tunnels(m, 1))
            await settle(list(pids.values()))
            base = {k: Sample.of(p) for k, p in pids.items()}

            reader, writer = await m.socks5()
            sent = hashlib.sha256()
            offered = await push_until_stalled(writer, sent, limit)
            await asyncio.gather(*(echo_transfer(m, 16 * MiB) for _ in range(4)))
            peak = {k: Sample.of(p) for k, p in pids.items()}

            # Bounded by windows and buffers (two 4 MiB stream windows, write high-water marks, the kernels'
            # socket buffers), far below what the client was ready to send.
            assert offered < limit // 2, f"{offered / MiB:.0f} MiB taken from a client that never reads"
            for k in pids:
                grown = (peak[k].rss_kib - base[k].rss_kib) / 1024
                assert grown < 64, f"node {k} grew by {grown:.0f} MiB holding a stalled stream"
            # All of it on the one pooled connection: node B gained the stalled tunnel's app socket and nothing else
            # (once the four transfers' app sockets, which node B closes just after their clients see the end, are
            # gone: under load that takes a moment).
            for _ in range(50):
                if (fds := Sample.of(pids["b"]).fds) <= base["b"].fds + 1:
                    break
                await asyncio.sleep(0.1)
            assert fds == base["b"].fds + 1, (fds, base["b"].fds)

            writer.write_eof()
            got = hashlib.sha256()
            received = 0
            while data := await asyncio.wait_for(reader.read(1 << 20), 30):
                got.update(data)
                received += len(data)
            writer.close()
            assert received == offered and got.hexdigest() == sent.hexdigest()
    finally:
        await echo.stop()


async def test_short_soak_gives_back_every_descriptor(tmp_path: Path) -> None:
    """``make soak`` in miniature (tests/soak.py, 3 s): every kind of traffic works without an error and both
    processes end with the descriptors they started with. Too short for the RSS criterion; the 10-minute run has it."""
    failures = await soak.run(tmp_path, duration=3, warmup=1, pool_release=1, check_rss=False)
    assert not failures


def test_pooled_connection_forgets_old_streams() -> None:
    """A pooled HBONE connection lives as long as it is used, carrying any number of streams: what it remembers per
    closed stream is bounded (h2 alone would keep the last 65,536, ~11 MiB), yet a late frame on a recently reset stream
    is still answered with RST_STREAM rather than a connection error."""
    c, s, _ = connected()
    late = c.send_connect("10.0.0.1:8080", [])
    pump(c, s)
    s.send_response(late, 200)
    pump(s, c)
    s.reset_stream(late, ErrorCode.CANCEL)
    s.data_to_send()  # the RST_STREAM is on its way; the client's trailers cross it
    for i in range(2500):
        sid = c.send_connect("10.0.0.1:8080", [])
        pump(c, s)
        s.send_response(sid, 200)
        pump(s, c)
        if i % 2:
            c.reset_stream(sid, ErrorCode.CANCEL)
        else:
            c.end_stream(sid)
            s.end_stream(sid)
        pump(c, s)
        pump(s, c)
        if i == 10:
            # Not indexed: the client's real encoder and the server's decoder must keep agreeing on their tables.
            h = HeadersFrame(late, hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple("x-late", "1")]))
            h.flags.add("END_HEADERS")
            h.flags.add("END_STREAM")
            assert s.receive_data(h.serialize()) == []
            assert [type(f) for f in frames(s.data_to_send())] == [RstStreamFrame]
    assert len(c._closed) <= 1024 and len(s._closed) <= 1024


async def test_idle_pooled_connection_is_released_although_pings_flow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ends PING an idle HBONE connection every 10 s; that is not use. With POOL_UNUSED_RELEASE_TIMEOUT longer
    than the PING interval (the default: 5 min vs 10 s) the connection must still be released, and its descriptors
    on both nodes with it (the soak found connections held forever)."""
    monkeypatch.setattr(connection, "PING_INTERVAL", 0.05)  # a PING each way every 50 ms, timeout 0.5 s
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    try:
        async with (
            running_app(m.env_b()) as b,
            running_app(m.env_a(POOL_UNUSED_RELEASE_TIMEOUT="300ms")) as a,
        ):
            assert isinstance(a, App) and isinstance(b, App) and a.proxy and b.proxy
            pool, inbound = a.proxy.pi.pool, b.proxy.inbound
            await close_tunnels(await open_tunnels(m, 1))
            assert len(pool) == 1 and len(inbound.connections) == 1
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while (len(pool) or inbound.connections) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert len(pool) == 0, "the idle pooled connection was never released"
            assert not inbound.connections
    finally:
        await echo.stop()
