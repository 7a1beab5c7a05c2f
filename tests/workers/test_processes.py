"""Worker processes for real: ztunnels started through the CLI (``python -m ztunnel proxy``) with
``ZTUNNEL_WORKER_THREADS=2``, node A's SOCKS5 -> HBONE -> node B -> echo app, on loopback.

What each test holds: connections land on both workers (``/connections`` names the worker of each); 64 MiB each way
arrive intact; ``/metrics`` totals are exactly the sum of what each worker carried; a worker killed with SIGKILL
takes only its own tunnels and is replaced; SIGTERM drains every process and all of them exit; a second SIGINT ends
them at once; the workers die with a control process killed with SIGKILL; one worker still runs beside the control
process; a running worker has no gRPC or aiohttp loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ztunnel.testing import (
    EchoServer,
    TwoNodeMesh,
    ZtunnelProcess,
    eventually,
    scrape,
    send_and_read_echo,
    worker_pids,
)

pytestmark = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <_io.FileIO name='[^']*\.log':pytest.PytestUnraisableExceptionWarning"
)

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def start_pair(m: TwoNodeMesh, workers: str = "2", **extra: str) -> tuple[ZtunnelProcess, ZtunnelProcess]:
    b = ZtunnelProcess(m.env_b(ZTUNNEL_WORKER_THREADS=workers, **extra), m.workdir / "b.log").start()
    try:
        a = ZtunnelProcess(m.env_a(ZTUNNEL_WORKER_THREADS=workers, **extra), m.workdir / "a.log").start()
    except BaseException:
        b.stop()
        raise
    return a, b


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodeMesh]:
    """Two ztunnels with two workers each, shared by the tests that only add traffic."""
    m = TwoNodeMesh(tmp_path_factory.mktemp("workers"))
    a, b = start_pair(m)
    try:
        assert (len(a.children()), len(b.children())) == (2, 2)  # the tunnels below cross two worker processes
        yield m
    finally:
        codes = a.stop(), b.stop()
    assert codes == (0, 0), f"exit codes {codes}; logs in {m.workdir}"


@pytest.fixture
async def echo(mesh: TwoNodeMesh) -> AsyncIterator[EchoServer]:
    server = await EchoServer().start(*mesh.server_app)
    yield server
    await server.stop()


def get_json(ip: str, path: str) -> Any:
    with urllib.request.urlopen(f"http://{ip}:15000{path}", timeout=10) as r:
        return json.loads(r.read())


async def connections(ip: str) -> list[dict[str, Any]]:
    return list(await asyncio.to_thread(get_json, ip, "/connections"))


def ready(ip: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{ip}:15021/healthz/ready", timeout=5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


async def open_echoed(m: TwoNodeMesh, n: int) -> list[Conn]:
    """``n`` tunnels through node A, all open at once, each having echoed one line."""

    async def one(i: int) -> Conn:
        reader, writer = await m.socks5()
        writer.write(b"hello %d\n" % i)
        assert await asyncio.wait_for(reader.readline(), 10) == b"hello %d\n" % i
        return reader, writer

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def port_of(conn: Conn) -> int:
    return int(conn[1].get_extra_info("sockname")[1])


async def worker_of(ip: str, conns: list[Conn]) -> dict[int, int]:
    """{client port: worker index} of node A's outbound rows for ``conns`` (all of them must be listed)."""
    ports = {port_of(c) for c in conns}
    found: dict[int, int] = {}
    for _ in range(100):
        found = {
            int(r["src"].rsplit(":", 1)[1]): r["worker"]
            for r in await connections(ip)
            if r["direction"] == "outbound" and int(r["src"].rsplit(":", 1)[1]) in ports
        }
        if len(found) == len(ports):
            break
        await asyncio.sleep(0.05)
    assert set(found) == ports, f"{len(ports) - len(found)} connections missing from /connections"
    return found


async def close_all(conns: list[Conn]) -> None:
    for reader, writer in conns:
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 10)
        writer.close()


def total(samples: list[Any], name: str, **labels: str) -> float:
    return float(
        sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
    )


def by_worker(samples: list[Any], name: str) -> dict[str, float]:
    return {s.labels["worker"]: s.value for s in samples if s.name == name}


# -- the shared mesh -------------------------------------------------------------------------------------------------


async def test_connections_land_on_both_workers(mesh: TwoNodeMesh, echo: EchoServer) -> None:
    conns = await open_echoed(mesh, 40)
    try:
        where = await worker_of(mesh.node_a, conns)
        # SO_REUSEPORT spreads them by their addresses: all 40 on one worker would be a 1 in 2^39 chance.
        assert set(where.values()) == {0, 1}, Counter(where.values())
        inbound = [r for r in await connections(mesh.node_b) if r["direction"] == "inbound"]
        assert {r["worker"] for r in inbound} <= {0, 1} and inbound
    finally:
        await close_all(conns)


async def test_64mib_each_way_intact(mesh: TwoNodeMesh, echo: EchoServer) -> None:
    total_bytes = 64 << 20
    reader, writer = await mesh.socks5()
    echoed = await send_and_read_echo(reader, writer, os.urandom(1 << 20), total_bytes >> 20, 120)
    assert echoed.received == total_bytes and echoed.got_sha256 == echoed.sent_sha256
    assert echo.received == total_bytes


async def test_metrics_totals_are_exactly_the_sum_over_workers(mesh: TwoNodeMesh, echo: EchoServer) -> None:
    labels = {"reporter": "source"}
    before = await scrape(mesh.node_a)
    conns = await open_echoed(mesh, 30)
    sizes = [1000 * i + 7 for i in range(30)]
    for (_, writer), size in zip(conns, sizes, strict=True):
        writer.write(b"x" * size)
    for (reader, _), size in zip(conns, sizes, strict=True):
        await asyncio.wait_for(reader.readexactly(size), 10)
    where = await worker_of(mesh.node_a, conns)
    carried = Counter(where.values())  # what each worker carried, by /connections
    assert set(carried) == {0, 1}
    await close_all(conns)
    rows: list[dict[str, Any]] = []
    for _ in range(200):  # the tunnels close on node A a moment after the client saw EOF
        rows = [r for r in await connections(mesh.node_a) if r["direction"] == "outbound"]
        if not rows:
            break
        await asyncio.sleep(0.05)
    assert rows == []
    after = await scrape(mesh.node_a)

    def delta(name: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    lines = sum(len(b"hello %d\n" % i) for i in range(30))
    assert delta("istio_tcp_connections_opened_total") == 30
    assert delta("istio_tcp_connections_closed_total") == 30
    assert delta("istio_tcp_received_bytes_total") == sum(sizes) + lines  # client -> server
    assert delta("istio_tcp_sent_bytes_total") == sum(sizes) + lines  # the echo
    opened_before = by_worker(before, "ztunnel_worker_connections_opened_total")
    opened_after = by_worker(after, "ztunnel_worker_connections_opened_total")
    assert {w: opened_after[w] - opened_before.get(w, 0) for w in opened_after} == {
        str(w): float(n) for w, n in carried.items()
    }
    # Families only the control process writes are there once, not once per process.
    assert [s.value for s in after if s.name == "istio_build"] == [1.0]
    assert len([s for s in after if s.name == "process_max_fds"]) == 1
    assert by_worker(after, "ztunnel_worker_up") == {"0": 1.0, "1": 1.0}


async def test_a_log_filter_set_on_the_admin_reaches_the_workers(mesh: TwoNodeMesh, echo: EchoServer) -> None:
    def post(query: str) -> str:
        req = urllib.request.Request(f"http://{mesh.node_a}:15000/logging?{query}", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return str(r.read().decode())

    log = mesh.workdir / "a.log"
    assert "access=debug" in await asyncio.to_thread(post, "level=access=debug")
    try:
        conns = await open_echoed(mesh, 10)  # on both workers (10 on one alone: a 1 in 512 chance)
        ports = {port_of(c) for c in conns}
        where = await worker_of(mesh.node_a, conns)
        await close_all(conns)
        # "connection opened" is an access line at debug, written by the worker that holds the connection.
        opened = await eventually(
            lambda: {
                p
                for p in ports
                if f":{p} " in "".join(line for line in log.read_text().splitlines() if "connection opened" in line)
            },
            10,
            until=lambda got: got == ports,
        )
        assert opened == ports and set(where.values()) == {0, 1}
    finally:
        await asyncio.to_thread(post, "reset")


async def test_a_worker_leaves_sigint_and_sigterm_to_the_control_process(mesh: TwoNodeMesh, echo: EchoServer) -> None:
    # A terminal's Ctrl-C or systemd's SIGTERM to every process of the unit reaches the workers too: they must not
    # cut their tunnels for it (the control process, which gets it as well, drains them).
    conns = await open_echoed(mesh, 10)
    pids = worker_pids((mesh.workdir / "a.log").read_text())
    for pid in pids.values():
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
    assert [await echoes(c) for c in conns] == [True] * len(conns)
    assert all(alive(pid) for pid in pids.values())
    assert by_worker(await scrape(mesh.node_a), "ztunnel_worker_restarts_total") == {"0": 0.0, "1": 0.0}
    await close_all(conns)


def test_a_running_worker_has_no_grpc_or_aiohttp_loaded(mesh: TwoNodeMesh) -> None:
    log = (mesh.workdir / "a.log").read_text()
    pids = worker_pids(log)
    assert sorted(pids) == [0, 1]
    for pid in pids.values():
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "cygrpc" not in maps and "/aiohttp/" not in maps, pid
        assert "/uvloop/" in maps  # the check sees the extension modules a worker does load


# -- a ztunnel of its own per test -----------------------------------------------------------------------------------


@pytest.fixture
def own(tmp_path: Path) -> Iterator[tuple[TwoNodeMesh, ZtunnelProcess, ZtunnelProcess]]:
    m = TwoNodeMesh(tmp_path)
    a, b = start_pair(m, CONNECTION_TERMINATION_DEADLINE="30s")
    try:
        yield m, a, b
    finally:
        for z in (a, b):
            z.stop()


async def echoes(conn: Conn, msg: bytes = b"still there?\n") -> bool:
    reader, writer = conn
    try:
        writer.write(msg)
        return await asyncio.wait_for(reader.readexactly(len(msg)), 10) == msg
    except (ConnectionError, asyncio.IncompleteReadError):
        return False


async def test_kill_9_of_a_worker_leaves_the_others_tunnels_and_is_replaced(
    own: tuple[TwoNodeMesh, ZtunnelProcess, ZtunnelProcess],
) -> None:
    m, _, _ = own
    echo = await EchoServer().start(*m.server_app)
    try:
        conns = await open_echoed(m, 30)
        where = await worker_of(m.node_a, conns)
        assert set(where.values()) == {0, 1}
        before = await scrape(m.node_a)
        log = m.workdir / "a.log"
        victim = worker_pids(log.read_text())[0]
        os.kill(victim, signal.SIGKILL)
        survivors = [c for c in conns if where[port_of(c)] == 1]
        dead = [c for c in conns if where[port_of(c)] == 0]
        assert [await echoes(c) for c in survivors] == [True] * len(survivors)
        assert [await echoes(c) for c in dead] == [False] * len(dead)

        # A new worker 0 is started and serves: readiness comes back, new tunnels reach both workers again.
        replaced = await eventually(lambda: worker_pids(log.read_text()).get(0), 30, until=lambda p: p != victim)
        assert replaced != victim
        assert await eventually(lambda: ready(m.node_a), 30)
        assert f"worker 0 (pid {victim}) was killed by SIGKILL" in log.read_text()
        fresh = await open_echoed(m, 30)
        assert set((await worker_of(m.node_a, fresh)).values()) == {0, 1}
        after = await scrape(m.node_a)
        # What the dead worker had counted is kept: no series goes backwards.
        opened = "istio_tcp_connections_opened_total"
        assert total(after, opened) == total(before, opened) + 30
        assert by_worker(after, "ztunnel_worker_restarts_total") == {"0": 1.0, "1": 0.0}
        assert [await echoes(c) for c in survivors] == [True] * len(survivors)
        for _, w in conns + fresh:
            w.close()
    finally:
        await echo.stop()


async def test_sigterm_drains_every_worker_and_all_processes_exit(
    own: tuple[TwoNodeMesh, ZtunnelProcess, ZtunnelProcess],
) -> None:
    m, a, _ = own
    echo = await EchoServer().start(*m.server_app)
    try:
        conns = await open_echoed(m, 10)
        assert set((await worker_of(m.node_a, conns)).values()) == {0, 1}
        workers = a.children()
        assert len(workers) == 2
        assert a.proc is not None
        a.proc.send_signal(signal.SIGTERM)
        assert not await eventually(lambda: ready(m.node_a), 10, until=lambda r: not r)
        # Draining: the open tunnels still carry bytes (the deadline is 30 s), on both workers.
        assert [await echoes(c) for c in conns] == [True] * len(conns)
        await close_all(conns)
        code = await asyncio.to_thread(a.proc.wait, 30)
        assert code == 0
        assert [pid for pid in workers if alive(pid)] == []
    finally:
        await echo.stop()


async def test_a_second_sigint_ends_the_drain_at_once(own: tuple[TwoNodeMesh, ZtunnelProcess, ZtunnelProcess]) -> None:
    m, a, _ = own
    echo = await EchoServer().start(*m.server_app)
    try:
        conns = await open_echoed(m, 10)
        workers = a.children()
        assert len(workers) == 2 and a.proc is not None
        a.proc.send_signal(signal.SIGINT)
        assert not await eventually(lambda: ready(m.node_a), 10, until=lambda r: not r)
        assert await echoes(conns[0])  # the first SIGINT drains gracefully (30 s)
        a.proc.send_signal(signal.SIGINT)
        # Well within the 30 s deadline: every tunnel is cut and every process is gone.
        for reader, _ in conns:
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(reader.read(), 20) == b""
        assert await asyncio.to_thread(a.proc.wait, 20) == 0
        assert [pid for pid in workers if alive(pid)] == []
        assert "received second SIGINT, exiting immediately" in (m.workdir / "a.log").read_text()
    finally:
        await echo.stop()


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_killing_the_control_process_leaves_no_worker(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    a = ZtunnelProcess(m.env_a(ZTUNNEL_WORKER_THREADS="2"), tmp_path / "a.log").start()
    try:
        workers = a.children()
        assert len(workers) == 2 and all(alive(p) for p in workers)
        assert a.proc is not None
        a.proc.kill()
        a.proc.wait()
        assert await eventually(lambda: [p for p in workers if alive(p)], 20, until=lambda left: not left) == []
    finally:
        a.stop()


async def test_one_worker_runs_beside_the_control_process(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    a, b = start_pair(m, workers="1")
    echo = await EchoServer().start(*m.server_app)
    try:
        (worker,) = a.children()
        assert a.proc is not None and worker != a.proc.pid
        conns = await open_echoed(m, 5)
        assert set((await worker_of(m.node_a, conns)).values()) == {0}
        # The data-plane listeners are the worker's alone: the control process serves only admin, stats, readiness.
        listeners = await asyncio.to_thread(
            subprocess.run,
            ["ss", "-Hltnp", f"src {m.node_a}"],
            capture_output=True,
            text=True,
            check=True,
        )
        owners: dict[int, set[int]] = {}
        for line in listeners.stdout.splitlines():
            port = int(line.split()[3].rsplit(":", 1)[1])
            owners[port] = {int(x) for x in re.findall(r"pid=(\d+)", line)}
        assert owners[15001] == owners[15008] == owners[15006] == owners[15080] == {worker}
        assert owners[15000] == owners[15020] == owners[15021] == {a.proc.pid}
        await close_all(conns)
    finally:
        await echo.stop()
        a.stop()
        b.stop()


async def test_a_port_in_use_fails_the_start_as_in_one_process(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    holder = socket.socket()
    holder.bind((m.node_a, 15008))
    holder.listen()
    try:
        env = {"PATH": os.environ.get("PATH", ""), **m.env_a(ZTUNNEL_WORKER_THREADS="2")}
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "ztunnel", "proxy"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        holder.close()
    assert proc.returncode == 1
    assert f"error: inbound listener {m.node_a}:15008: Address already in use" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
