"""The balance of inbound HBONE connections for real: node B is a ztunnel (``python -m ztunnel proxy``) with two
workers, the client is the test, dialling 15008 with a raw HBONE connection (real TLS, real HTTP/2) from source
ports it chooses, to the echo app behind B.

The kernel picks a connection's worker by hashing its addresses (SO_REUSEPORT), the same way for the same addresses
as long as the workers' listeners stay the same; a connection that reaches an idle ztunnel is never moved (nothing
is less loaded than nothing). So a probe from a source port, on an idle B, shows where the kernel puts that port's
connections, and the probe's close (a reset: no TIME_WAIT holds the port) leaves the port free for the real
connection. Two ports the kernel puts on one worker are what the balance must fix: without it both connections,
and every stream on them, stay on that worker.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import struct
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.workers.test_processes import connections, total
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.tasks import TaskGroup
from ztunnel.testing import (
    EchoServer,
    TwoNodeMesh,
    ZtunnelProcess,
    eventually,
    hbone_dial,
    hbone_tunnel,
    scrape,
    worker_pids,
)

pytestmark = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <_io.FileIO name='[^']*\.log':pytest.PytestUnraisableExceptionWarning"
)

CLIENT = Identity("cluster.local", "default", "client")
HANDOFFS = "ztunnel_worker_inbound_handoffs_total"
TASKS = TaskGroup("test")


class NodeB:
    """Ztunnel B with two workers and its echo app; the test's HBONE client dials from node A's address."""

    def __init__(self, m: TwoNodeMesh, z: ZtunnelProcess, echo: EchoServer) -> None:
        self.m = m
        self.z = z
        self.echo = echo
        self.cert = LocalCA.load_or_create(m.ca_dir, "cluster.local").issue(CLIENT, timedelta(hours=1))
        self.authority = f"{m.server_app[0]}:{m.server_app[1]}"
        self.log = m.workdir / "b.log"

    async def dial(self, port: int) -> Any:
        return await hbone_dial((self.m.node_b, 15008), self.cert, local_addr=(self.m.node_a, port))

    async def rows(self) -> list[dict[str, Any]]:
        return [r for r in await connections(self.m.node_b) if r["direction"] == "inbound"]

    async def idle(self) -> None:
        """Wait until B has no inbound connection left (each worker's count is back to 0)."""
        for _ in range(400):
            if not await self.rows():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"B still has inbound connections: {await self.rows()}")


async def row_of(node: NodeB, port: int) -> dict[str, Any]:
    src = f"{node.m.node_a}:{port}"
    for _ in range(200):
        rows = [r for r in await node.rows() if r["src"] == src]
        if rows:
            assert len(rows) == 1, rows
            return rows[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no inbound row from {src} in {await node.rows()}")


def reset(conn: Any) -> None:
    """Close with a reset (SO_LINGER 0): no TIME_WAIT keeps the source port, which the test dials from again."""
    sock = conn.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.abort("probe done")


async def landing(node: NodeB, port: int) -> int:
    """The worker the kernel gives connections from ``port`` (B idle, so the probe is not moved)."""
    conn = await node.dial(port)
    try:
        status, _, writer = await hbone_tunnel(conn, node.authority)
        assert status == 200
        worker = int((await row_of(node, port))["worker"])
        writer.close()
    finally:
        reset(conn)
    await node.idle()
    return worker


async def colliding_ports(node: NodeB) -> tuple[int, int, int]:
    """Two source ports whose connections the kernel gives the same worker, and that worker (with two workers, the
    third probe at the latest finds them)."""
    seen: dict[int, int] = {}
    for port in random.sample(range(20000, 61000), 40):
        try:
            worker = await landing(node, port)
        except OSError:  # the port is taken on this machine: another
            continue
        if worker in seen:
            return seen[worker], port, worker
        seen[worker] = port
    raise AssertionError(f"no two ports on one worker: {seen}")


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[NodeB]:
    m = TwoNodeMesh(tmp_path)
    env = m.env_b(ZTUNNEL_WORKER_THREADS="2", RUST_LOG="info,ztunnel::workers=debug")
    z = ZtunnelProcess(env, tmp_path / "b.log").start()
    echo = await EchoServer().start(*m.server_app)
    try:
        assert len(z.children()) == 2
        yield NodeB(m, z, echo)
    finally:
        await echo.stop()
        code = z.stop()
    assert code == 0, f"exit code {code}; log in {tmp_path / 'b.log'}"


async def echo_with_half_close(stream: tuple[Any, asyncio.StreamReader, asyncio.StreamWriter], size: int) -> int:
    """``size`` random bytes out, our FIN, then everything echoed back until the app's FIN; returns the size."""
    _, reader, writer = stream
    payload = os.urandom(size)

    async def send() -> None:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()

    _, got = await asyncio.wait_for(asyncio.gather(send(), reader.read()), 30)
    writer.close()
    assert got == payload
    return size


def handoffs(samples: list[Any]) -> dict[tuple[str, str], float]:
    return {(s.labels["worker"], s.labels["to"]): s.value for s in samples if s.name == HANDOFFS}


def by_worker(samples: list[Any], name: str) -> dict[str, float]:
    return {s.labels["worker"]: s.value for s in samples if s.name == name}


def access_lines(log: Path, src: str, since: int = 0) -> list[str]:
    """The access log's lines of connections from ``src``, from byte ``since`` of the log on."""
    text = log.read_bytes()[since:].decode()
    return [line for line in text.splitlines() if "connection complete" in line and f"{src} " in line]


async def test_two_connections_the_kernel_gives_one_worker_end_on_both(node: NodeB) -> None:
    p1, p2, x = await colliding_ports(node)
    y = 1 - x
    before = await scrape(node.m.node_b)
    since = node.log.stat().st_size  # the probes' lines come before
    c1 = await node.dial(p1)
    t1 = await hbone_tunnel(c1, node.authority)
    assert (await row_of(node, p1))["worker"] == x  # the first stays where the kernel put it
    c2 = await node.dial(p2)
    t2 = await hbone_tunnel(c2, node.authority)
    assert (t1[0], t2[0]) == (200, 200)
    # The kernel gave the second one to worker x as well (the probe showed it); it is served by y.
    assert (await row_of(node, p2))["worker"] == y

    # Bytes both ways, intact, and each side's end of stream, across the handoff and beside it.
    sizes = await asyncio.gather(echo_with_half_close(t1, 3 << 20), echo_with_half_close(t2, (2 << 20) + 7))
    c1.close("done")
    c2.close("done")
    await node.idle()
    after = await scrape(node.m.node_b)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # Counted once each, by the worker that served it.
    dest = {"reporter": "destination"}
    assert delta("istio_tcp_connections_opened_total", **dest) == 2
    assert delta("istio_tcp_connections_closed_total", **dest) == 2
    assert delta("istio_tcp_received_bytes_total", **dest) == sum(sizes)
    assert delta("istio_tcp_sent_bytes_total", **dest) == sum(sizes)
    opened = "ztunnel_worker_connections_opened_total"
    per_worker = {w: v - by_worker(before, opened).get(w, 0) for w, v in by_worker(after, opened).items()}
    assert per_worker == {str(x): 1.0, str(y): 1.0}
    moved = {k: v - handoffs(before).get(k, 0) for k, v in handoffs(after).items()}
    assert {k: v for k, v in moved.items() if v} == {(str(x), str(y)): 1.0}
    for port in (p1, p2):
        lines = await eventually(lambda port=port: access_lines(node.log, f"{node.m.node_a}:{port}", since), 10)  # type: ignore[misc]
        assert len(lines) == 1, lines
    assert node.echo.connections >= 2


async def test_a_connection_handed_to_a_worker_that_dies_meanwhile_is_not_lost(node: NodeB) -> None:
    p1, p2, x = await colliding_ports(node)
    y = 1 - x
    victim = worker_pids(node.log.read_text())[y]
    c1 = await node.dial(p1)
    t1 = await hbone_tunnel(c1, node.authority)
    assert t1[0] == 200 and (await row_of(node, p1))["worker"] == x
    os.kill(victim, signal.SIGSTOP)  # y takes nothing from now on: the handoff waits for its answer
    try:
        dialing = TASKS.spawn(node.dial(p2), "dial")
        handing = f"inbound connection accepted by worker {x}: handing it to worker {y}"
        assert await eventually(lambda: handing in node.log.read_text(), 10)
        assert not dialing.done()  # no one has answered the client's handshake yet
    finally:
        os.kill(victim, signal.SIGKILL)  # dies without answering
    c2 = await dialing
    t2 = await hbone_tunnel(c2, node.authority)
    assert t2[0] == 200
    assert (await row_of(node, p2))["worker"] == x  # back where it was accepted
    await asyncio.gather(echo_with_half_close(t1, 1 << 20), echo_with_half_close(t2, 1 << 20))
    log = node.log.read_text()
    assert f"went to worker {x} instead of {y}" in log
    assert re.search(rf"worker {y} \(pid {victim}\) was killed by SIGKILL", log)
    samples = await scrape(node.m.node_b)
    assert handoffs(samples) == {(str(x), str(x)): 1.0}
    c1.close("done")
    c2.close("done")
