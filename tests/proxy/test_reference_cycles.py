"""No connection leaves reference cycles behind: what a closed connection held is freed by reference counting.

Why it matters: objects in a cycle live until the cyclic collector finds them, and the collector runs once per ~700
net container allocations. Before this test a connection through both nodes left 52 such objects (its
ConnectionRecord <-> HboneStream: the record's byte counters and closer are the stream's bound methods, the stream's
``on_done`` closes over the record; the transports, buffers and task hung off them), so node A and B ran a
generation-0 collection every ~19 connections and carried the garbage meanwhile (bench/README.md "Optimisations").

Two in-process ztunnels (node A: SOCKS5 in, HBONE out; node B: HBONE in, the app out); per case a few warm-up
connections, then ``gc`` off with ``DEBUG_SAVEALL`` for N connections and one collection: what it finds is what the
connections left in cycles. Only the proxies' objects count (types from ztunnel and uvloop, and the frames, tasks,
futures and closures of ztunnel's code): the test client's own exceptions and tracebacks are the client's business.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import types
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import uvloop

from ztunnel.testing import EchoServer, TwoNodeMesh, running_app

N = 20


def _ours(o: object) -> bool:
    """Whether ``o`` is the proxies' (not the test client's) object."""
    module = type(o).__module__ or ""
    if module.startswith(("ztunnel", "uvloop")):
        return True
    code = None
    if isinstance(o, types.FrameType):
        code = o.f_code
    elif isinstance(o, types.CoroutineType):
        code = o.cr_code
    elif isinstance(o, types.FunctionType):
        code = o.__code__
    elif isinstance(o, types.MethodType):
        return _ours(o.__self__)
    elif isinstance(o, asyncio.Task):
        return _ours(o.get_coro())
    return code is not None and "/ztunnel/" in code.co_filename and "/testing/" not in code.co_filename


def _describe(o: object) -> str:
    if isinstance(o, types.MethodType):
        return f"method {o.__func__.__qualname__}"
    if isinstance(o, types.FunctionType | types.CoroutineType):
        return f"{type(o).__name__} {o.__qualname__}"
    return type(o).__qualname__


async def _echo(mesh: TwoNodeMesh, host: str | None = None, port: int | None = None) -> None:
    reader, writer = await mesh.socks5(host, port)
    writer.write(b"x")
    assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"
    writer.close()
    await writer.wait_closed()


async def _refused(mesh: TwoNodeMesh, host: str, port: int) -> None:
    with pytest.raises(ConnectionError):
        reader, writer = await mesh.socks5(host, port)
        # Node A answers the SOCKS5 request before node B's verdict (upstream does too): then the close tells it.
        writer.write(b"x")
        assert await asyncio.wait_for(reader.read(1), 10) == b""
        writer.close()
        await writer.wait_closed()
        raise ConnectionError("closed")


async def _client_reset(mesh: TwoNodeMesh) -> None:
    reader, writer = await mesh.socks5()
    writer.write(b"x")
    assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"
    writer.transport.abort()  # RST, not FIN


Case = Callable[[TwoNodeMesh], Awaitable[None]]
CASES: dict[str, Case] = {
    "hbone through a service VIP": _echo,
    "client resets mid-stream": _client_reset,
    "plain TCP passthrough": lambda mesh: _echo(mesh, mesh.plain, 7000),
    "denied by node B's policy": lambda mesh: _refused(mesh, mesh.node_b, 9999),
    "no app listening on node B": lambda mesh: _refused(mesh, mesh.node_b, 7001),
}


async def _leftovers(workdir: Path) -> dict[str, collections.Counter[str]]:
    mesh = TwoNodeMesh(workdir)
    out: dict[str, collections.Counter[str]] = {}
    echo = await EchoServer().start(*mesh.server_app)
    plain = await EchoServer().start(mesh.plain, 7000)
    try:
        async with running_app(mesh.env_b(RUST_LOG="error")), running_app(mesh.env_a(RUST_LOG="error")):
            for name, case in CASES.items():
                for _ in range(3):
                    await case(mesh)
                await asyncio.sleep(0.2)
                with _SavingGarbage() as garbage:
                    for _ in range(N):
                        await case(mesh)
                    await asyncio.sleep(0.2)  # both nodes finish closing the last connection
                out[name] = collections.Counter(_describe(o) for o in garbage if _ours(o))
                garbage.clear()  # else this case's cycles are the next case's garbage
    finally:
        await plain.stop()
        await echo.stop()
    return out


class _SavingGarbage:
    """``gc`` off and everything found unreachable kept (``DEBUG_SAVEALL``) while inside; the garbage is collected
    once on the way out into the list it gave. Objects that existed on the way in are held meanwhile, so none of them
    is found: what an earlier test left for its last reference to drop (a whole app and its loop, released inside the
    window by the log thread or a timer: it failed once that way in a full run) is not the connections' garbage."""

    def __init__(self) -> None:
        self.garbage: list[object] = []
        self._before: list[object] = []

    def __enter__(self) -> list[object]:
        gc.collect()
        self._before = gc.get_objects()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        return self.garbage

    def __exit__(self, *exc: object) -> None:
        try:
            gc.collect()
            self.garbage.extend(gc.garbage)
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
            self._before = []
            gc.enable()


@pytest.fixture(scope="module")
def leftovers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, collections.Counter[str]]:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_leftovers(tmp_path_factory.mktemp("cycles")))


@pytest.mark.parametrize("case", list(CASES))
def test_connection_leaves_no_cycles(leftovers: dict[str, collections.Counter[str]], case: str) -> None:
    found = leftovers[case]
    per_connection = {name: count / N for name, count in found.most_common()}
    assert not found, f"{case}: objects left in reference cycles per connection: {per_connection}"
