"""The small HTTP servers (admin 15000, stats 15020, readiness 15021) on aiohttp, bound as upstream binds them.

Sockets are made here rather than by aiohttp's ``TCPSite``: a ``[::]`` site from asyncio is IPv6-only
(``IPV6_V6ONLY=1``), so an IPv4 kubelet probe or Prometheus scrape would never connect. Ours accept both families,
and ``localhost`` binds 127.0.0.1 and ::1, as the proxy listeners do.
"""

from __future__ import annotations

from typing import Any

from ztunnel.config import SocketAddress
from ztunnel.sockets import SocketConfig, SocketFactory


class HttpServer:
    """An aiohttp application served on every socket of one :class:`SocketAddress`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._runner: Any = None
        self.addresses: list[tuple[str, int]] = []

    @property
    def address(self) -> tuple[str, int] | None:
        return self.addresses[0] if self.addresses else None

    async def start(self, addr: SocketAddress) -> None:
        from aiohttp import web

        socks = SocketFactory(SocketConfig()).listeners(addr)
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        for sock, _ in socks:
            await web.SockSite(self._runner, sock).start()
            host, port = sock.getsockname()[:2]
            self.addresses.append((str(host), int(port)))

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
