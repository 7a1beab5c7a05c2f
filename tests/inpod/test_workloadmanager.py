"""The ZDS client's reconnect loop (upstream ``inpod/workloadmanager.rs``): backoff 10 ms doubling to 15 s, back to
10 ms once a snapshot was processed, and readiness following the connection. No namespaces: a unix SEQPACKET
"agent" in the test and a recording sleep instead of the clock."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from xds.istio.workload.zds import zds_pb2
from ztunnel.inpod.netns import Netns
from ztunnel.inpod.statemanager import WorkloadProxyManagerState
from ztunnel.inpod.workloadmanager import MAX_BACKOFF, READINESS_TASK, WorkloadProxyManager
from ztunnel.readiness import Readiness

# 10 ms doubling, capped at 15 s.
SCHEDULE = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 15.0, 15.0]


class Stop(Exception):
    """Raised by the recording sleep to end ``run()``."""


def no_netns(fd: int) -> Netns:
    raise AssertionError("no add is sent in these tests")


def manager(
    path: Path, sleeps: list[float], hooks: dict[int, Callable[[], None]] | None = None
) -> WorkloadProxyManager:
    """A manager whose waits are recorded; ``hooks[n]()`` runs at the n-th wait, and the wait after the last hook
    (or after the whole schedule) ends the run."""
    hooks = hooks or {}
    last = max(hooks, default=len(SCHEDULE) - 1)

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        if len(sleeps) in hooks:
            hooks[len(sleeps)]()
        if len(sleeps) > last:
            raise Stop
        await asyncio.sleep(0)

    state = WorkloadProxyManagerState(factory=None, open_netns=no_netns)  # type: ignore[arg-type]  # no proxies
    return WorkloadProxyManager(str(path), state, Readiness(), sleep=sleep)


async def test_connect_failures_back_off_from_10ms_to_15s(tmp_path: Path) -> None:
    sleeps: list[float] = []
    m = manager(tmp_path / "absent.sock", sleeps)
    with pytest.raises(Stop):
        await m.run()
    assert sleeps == pytest.approx(SCHEDULE)
    assert max(sleeps) == MAX_BACKOFF
    assert m.readiness.pending() == [READINESS_TASK]


async def test_backoff_resets_after_a_snapshot_not_after_a_bare_connect(tmp_path: Path) -> None:
    path = tmp_path / "zds.sock"
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.setblocking(False)
    sleeps: list[float] = []
    seen: dict[str, object] = {}

    async def agent_drops_after_hello() -> None:
        conn, _ = await loop.sock_accept(listener)
        with conn:
            assert zds_pb2.ZdsHello.FromString(await loop.sock_recv(conn, 1024)).version == zds_pb2.V1

    async def agent_sends_a_snapshot_then_goes() -> None:
        conn, _ = await loop.sock_accept(listener)
        with conn:
            await loop.sock_recv(conn, 1024)  # hello
            req = zds_pb2.WorkloadRequest()
            req.snapshot_sent.SetInParent()
            await loop.sock_sendall(conn, req.SerializeToString())
            assert zds_pb2.WorkloadResponse.FromString(await loop.sock_recv(conn, 1024)).ack.error == ""
            seen["ready while connected"] = m.readiness.ready

    def agent_up() -> None:
        listener.bind(str(path))
        listener.listen(4)
        spawn(agent_drops_after_hello())

    tasks: list[asyncio.Task[None]] = []

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        tasks.append(loop.create_task(coro))

    m = manager(
        path,
        sleeps,
        {
            4: agent_up,  # waits 1-4 (10..80 ms) for an absent socket; then a connect and a drop after the hello
            5: lambda: spawn(agent_sends_a_snapshot_then_goes()),  # 160 ms: a bare connect reset nothing
            6: lambda: spawn(agent_sends_a_snapshot_then_goes()),  # 10 ms: the snapshot reset it, and again
        },
    )
    try:
        with pytest.raises(Stop):
            await m.run()
        await asyncio.gather(*tasks)
    finally:
        listener.close()
    assert sleeps == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.01, 0.01])
    assert m.connections == 3
    assert seen["ready while connected"] is True
    assert m.readiness.pending() == [READINESS_TASK]  # the agent went away: not ready again
