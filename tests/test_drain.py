"""Graceful drain of a real ztunnel process on SIGTERM: finishing connections complete, the rest are closed at the
deadline, readiness answers 500 meanwhile, and the process exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ztunnel.drain import drain_together
from ztunnel.testing import EchoServer, TwoNodeMesh, ZtunnelProcess


def readiness(host: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{host}:15021/healthz/ready", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


async def test_sigterm_drains_then_forces(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    node_b = ZtunnelProcess(m.env_b(), tmp_path / "b.log").start()
    node_a = ZtunnelProcess(m.env_a(CONNECTION_TERMINATION_DEADLINE="2s"), tmp_path / "a.log").start()
    try:
        finishing_r, finishing_w = await m.socks5()
        stuck_r, stuck_w = await m.socks5()
        for w in (finishing_w, stuck_w):
            w.write(b"a" * 1000)
        await finishing_r.readexactly(1000)
        await stuck_r.readexactly(1000)
        assert readiness(m.node_a) == 200

        assert node_a.proc is not None
        node_a.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        await asyncio.sleep(0.3)
        assert await asyncio.to_thread(readiness, m.node_a) == 500  # draining: not ready
        # The finishing connection sends the rest and half-closes within the deadline: every byte comes back.
        finishing_w.write(b"b" * 100_000)
        finishing_w.write_eof()
        rest = await asyncio.wait_for(finishing_r.read(), 5)
        assert rest == b"b" * 100_000
        # The stuck one is closed when the 2 s deadline passes (reset or EOF), not before.
        try:
            stuck = await asyncio.wait_for(stuck_r.read(), 10)
        except ConnectionResetError:
            stuck = b""
        elapsed = time.monotonic() - start
        assert stuck == b""
        assert 1.5 <= elapsed <= 6, elapsed
        code = await asyncio.to_thread(node_a.proc.wait, 10)
        assert code == 0
        log = (tmp_path / "a.log").read_text()
        assert "drain duration expired with pending connections" in log
        assert "connection closed due to connection drain" in log  # the stuck one's access log line, as upstream
        for w in (finishing_w, stuck_w):
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()
    finally:
        node_a.stop()
        node_b.stop()
        await echo.stop()


async def test_drain_with_no_connections_exits_at_once(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    node = ZtunnelProcess(m.env_a(), tmp_path / "a.log").start()
    assert node.proc is not None
    start = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(node.proc.wait, 10) == 0
    assert time.monotonic() - start < 3
    node.stop()


async def test_second_sigint_exits_at_once(tmp_path: Path) -> None:
    """A second SIGINT during a graceful drain exits without sitting out the deadline (upstream ``signal.rs``);
    the connection still open is closed, and its access log line says the drain closed it."""
    deadline = 30.0
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    node_b = ZtunnelProcess(m.env_b(), tmp_path / "b.log").start()
    node_a = ZtunnelProcess(m.env_a(CONNECTION_TERMINATION_DEADLINE=f"{deadline:g}s"), tmp_path / "a.log").start()
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await m.socks5()
        writer.write(b"a" * 1000)
        await reader.readexactly(1000)
        assert node_a.proc is not None
        node_a.proc.send_signal(signal.SIGINT)
        await asyncio.sleep(0.5)
        # The first SIGINT drains gracefully: the open connection keeps the process running.
        assert node_a.proc.poll() is None
        assert await asyncio.to_thread(readiness, m.node_a) == 500
        start = time.monotonic()
        node_a.proc.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(node_a.proc.wait, deadline)
        elapsed = time.monotonic() - start
        assert code == 0
        assert elapsed < deadline / 5, elapsed  # "immediately": nowhere near the 30 s the drain would have taken
        try:
            rest = await asyncio.wait_for(reader.read(), deadline / 5)
        except ConnectionResetError:
            rest = b""
        assert rest == b""
        log = (tmp_path / "a.log").read_text()
        assert "received second SIGINT, exiting immediately" in log
        assert "drain duration expired" not in log
        assert "connection closed due to connection drain" in log
    finally:
        if writer is not None:  # closed whatever happened: an open client would hang the test loop's close
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        node_a.stop()
        node_b.stop()
        await echo.stop()


async def test_one_failing_drain_never_cuts_the_others_short(caplog: pytest.LogCaptureFixture) -> None:
    """``drain_together``: the parts run side by side; one that raises is logged by name, the others run to their
    end (a failing pod's drain must not close the rest before their deadline)."""
    finished: list[str] = []
    release = asyncio.Event()

    async def fails() -> None:
        raise RuntimeError("its netns is gone")

    async def slow() -> None:
        await release.wait()
        finished.append("slow")

    together = asyncio.ensure_future(  # noqa: TID251 - test-owned, awaited below
        drain_together([("the proxies of pod a", fails()), ("the proxies of pod b", slow())])
    )
    await asyncio.sleep(0.05)
    assert not together.done()  # the failure did not end it: pod b is still draining
    release.set()
    await asyncio.wait_for(together, 5)
    assert finished == ["slow"]
    assert "draining the proxies of pod a failed: its netns is gone" in caplog.text
