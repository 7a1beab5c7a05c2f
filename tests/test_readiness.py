"""Readiness on 15021 as upstream's ``readiness/server.rs`` answers: 200 ``ready``, 500 listing the pending tasks
(sorted, comma-separated), 405 for any method but GET, 404 for any other path; the last two with empty bodies."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from ztunnel.config import SocketAddress
from ztunnel.readiness import Readiness, ReadinessServer


@pytest.fixture
async def served() -> AsyncIterator[tuple[Readiness, str]]:
    readiness = Readiness()
    server = ReadinessServer(readiness)
    await server.start(SocketAddress("127.0.0.1", 0))
    assert server.address is not None
    try:
        yield readiness, "http://{}:{}".format(*server.address)
    finally:
        await server.stop()


async def get(url: str, method: str = "GET") -> tuple[int, bytes, str | None]:
    async with aiohttp.ClientSession() as s, s.request(method, url) as r:
        return r.status, await r.read(), r.headers.get("Content-Type")


def is_ready(r: Readiness) -> bool:
    return r.ready  # (a call, so that mypy does not narrow the property between the checks)


def test_pending_tasks_are_sorted_and_released_once() -> None:
    r = Readiness()
    b = r.register("state manager")
    a = r.register("proxy")
    sub = a.subtask("dns proxy")
    assert r.pending() == ["dns proxy", "proxy", "state manager"] and not is_ready(r)
    a.release()
    a.release()  # harmless: the name is not released twice
    assert r.pending() == ["dns proxy", "state manager"]
    assert a.released.is_set() and not b.released.is_set()
    sub.release()
    b.release()
    assert r.pending() == [] and is_ready(r)
    draining = Readiness()
    draining.draining = True
    assert draining.pending() == [] and not is_ready(draining)  # draining is not ready, though nothing is pending


async def test_not_ready_lists_pending_tasks_then_ready(served: tuple[Readiness, str]) -> None:
    readiness, base = served
    proxy = readiness.register("proxy")
    state = readiness.register("state manager")
    dns = readiness.register("dns proxy")
    status, body, ctype = await get(base + "/healthz/ready")
    assert (status, body, ctype) == (500, b"not ready, pending: dns proxy, proxy, state manager\n", "text/plain")
    state.release()
    dns.release()
    assert (await get(base + "/healthz/ready"))[:2] == (500, b"not ready, pending: proxy\n")
    proxy.release()
    assert await get(base + "/healthz/ready") == (200, b"ready\n", "text/plain")


async def test_draining_is_not_ready(served: tuple[Readiness, str]) -> None:
    readiness, base = served
    readiness.draining = True
    assert (await get(base + "/healthz/ready"))[:2] == (500, b"not ready, pending: draining\n")


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"])
async def test_other_methods_are_405_with_no_body(served: tuple[Readiness, str], method: str) -> None:
    _, base = served
    status, body, _ = await get(base + "/healthz/ready", method)
    assert (status, body) == (405, b"")


@pytest.mark.parametrize("path", ["/", "/healthz", "/healthz/ready/", "/healthz/ready/x", "/ready", "/metrics"])
async def test_other_paths_are_404_with_no_body(served: tuple[Readiness, str], path: str) -> None:
    readiness, base = served
    readiness.register("proxy")  # the path decides before readiness does
    status, body, _ = await get(base + path)
    assert (status, body) == (404, b"")
    assert (await get(base + path, "POST"))[:2] == (404, b"")  # upstream matches the path first, then the method
