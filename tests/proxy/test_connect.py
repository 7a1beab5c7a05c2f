"""The backend connect of the inbound listeners (``connect_interruptible``): one timer per connect, which an
interruption (a policy change, a forced drain) ends at once, against real sockets."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import pytest

from ztunnel.proxy.common import CONNECTION_TIMEOUT, ResponseFlag
from ztunnel.proxy.connect import connect_interruptible
from ztunnel.proxy.connection_manager import ConnectionRecord, Direction
from ztunnel.sockets import SocketConfig, SocketFactory
from ztunnel.tasks import TaskGroup

LOCAL = ipaddress.ip_address("127.0.0.1")


def _record() -> ConnectionRecord:
    return ConnectionRecord(Direction.INBOUND, (LOCAL, 1), (LOCAL, 2))


async def test_one_timer_per_connect_and_no_timeout_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    """A completed connect arms one CONNECTION_TIMEOUT timer on the loop, cancelled once connected, and enters no
    asyncio.timeout scope (on Python 3.11 each costs a task lookup and two getpid system calls)."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    entered: list[Any] = []
    real = asyncio.timeout

    def counting(delay: float | None) -> asyncio.Timeout:
        entered.append(delay)
        return real(delay)

    monkeypatch.setattr(asyncio, "timeout", counting)
    loop = asyncio.get_running_loop()
    timers: list[asyncio.TimerHandle] = []
    real_call_later = loop.call_later

    def call_later(delay: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
        handle = real_call_later(delay, callback, *args, **kw)
        if delay == CONNECTION_TIMEOUT:
            timers.append(handle)
        return handle

    monkeypatch.setattr(loop, "call_later", call_later)
    record = _record()
    try:
        upstream = await connect_interruptible(SocketFactory(SocketConfig()), record, (LOCAL, port), None, False)
        assert upstream is not None and upstream.transport is not None
        upstream.close()
    finally:
        server.close()
    assert entered == []
    assert len(timers) == 1 and timers[0].cancelled()
    assert record.closer is None


async def test_an_interruption_ends_a_hanging_connect_at_once() -> None:
    """A connect that would hang (a listener whose backlog is full answers no SYN) ends as soon as the record's
    closer is called: None, not the 10 s timeout, and not a ProxyError."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        fillers = []
        for _ in range(8):  # fill the accept queue (backlog 0 still takes one or two)
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        record = _record()
        group = TaskGroup("test")
        task = group.spawn(
            connect_interruptible(SocketFactory(SocketConfig()), record, (LOCAL, port), None, False), "connect"
        )
        await asyncio.sleep(0.2)
        if task.done():  # the kernel took it after all: nothing to interrupt here
            for s in fillers:
                s.close()
            pytest.skip("the kernel accepted the connect despite the full backlog")
        assert record.closer is not None
        record.forced = (ResponseFlag.NONE, "policy changed")  # what the connection manager sets before the closer
        record.closer("policy changed")
        assert await asyncio.wait_for(task, 2) is None
        for s in fillers:
            s.close()
