"""Readiness: a registry of named tasks that must complete before ztunnel reports ready (upstream ``readiness.rs``).

``GET /healthz/ready`` on 15021 answers 200 ``ready`` when nothing is pending, else 500 listing what is. Draining
makes ztunnel not ready again so a rolling update stops sending it new work.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from ztunnel.config import SocketAddress
from ztunnel.http import HttpServer


class Readiness:
    def __init__(self) -> None:
        self._pending: Counter[str] = Counter()
        self.draining = False

    def register(self, name: str) -> BlockReady:
        """Block readiness on ``name`` until the returned token's :meth:`BlockReady.release` is called."""
        self._pending[name] += 1
        return BlockReady(self, name)

    def _release(self, name: str) -> None:
        self._pending[name] -= 1
        if self._pending[name] <= 0:
            del self._pending[name]

    def pending(self) -> list[str]:
        return sorted(self._pending)

    @property
    def ready(self) -> bool:
        return not self._pending and not self.draining


class BlockReady:
    """One pending readiness task; releasing twice is harmless. ``released`` is an event others can await."""

    def __init__(self, readiness: Readiness, name: str) -> None:
        self._readiness = readiness
        self.name = name
        self._released = False
        self.released = asyncio.Event()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._readiness._release(self.name)
            self.released.set()

    def subtask(self, name: str) -> BlockReady:
        return self._readiness.register(name)


class ReadinessServer:
    """``GET /healthz/ready`` on 15021: 200 ``ready`` or 500 ``not ready, pending: a, b`` (upstream format)."""

    def __init__(self, readiness: Readiness) -> None:
        self.readiness = readiness
        self._http: HttpServer | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        return self._http.address if self._http is not None else None

    async def start(self, addr: SocketAddress) -> None:
        from aiohttp import web

        # As upstream's readiness/server.rs: the two answers are ``text/plain`` (no charset); 405 for any other
        # method and 404 for any other path come with empty bodies.
        async def ready(request: web.Request) -> web.Response:
            if request.method != "GET":
                return web.Response(status=405)
            if self.readiness.ready:
                return web.Response(body=b"ready\n", content_type="text/plain")
            pending = self.readiness.pending()
            if self.readiness.draining:
                pending = sorted([*pending, "draining"])
            body = f"not ready, pending: {', '.join(pending)}\n".encode()
            return web.Response(status=500, body=body, content_type="text/plain")

        async def not_found(request: web.Request) -> web.Response:
            return web.Response(status=404)

        app = web.Application()
        app.router.add_route("*", "/healthz/ready", ready)
        app.router.add_route("*", "/{path:.*}", not_found)
        self._http = HttpServer(app, name="readiness")
        await self._http.start(addr)

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()
