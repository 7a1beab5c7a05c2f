"""The small HTTP servers (admin 15000, stats 15020, readiness 15021) on aiohttp, bound as upstream binds them.

Sockets are made here rather than by aiohttp's ``TCPSite``: a ``[::]`` site from asyncio is IPv6-only
(``IPV6_V6ONLY=1``), so an IPv4 kubelet probe or Prometheus scrape would never connect. Ours accept both families,
and ``localhost`` binds 127.0.0.1 and ::1, as the proxy listeners do.
"""

from __future__ import annotations

from typing import Any

from ztunnel.config import SocketAddress
from ztunnel.sockets import SocketConfig, SocketFactory


def _answer_bad_requests_in_http11() -> None:
    """A request aiohttp cannot parse (plaintext garbage, TLS to a plain port) is answered from a placeholder
    request that says HTTP/1.0, so the status line reads ``HTTP/1.0 400``. Upstream's hyper answers
    ``HTTP/1.1 400``, and clients check it (upstream's ``malicious_calls_inpod`` reads exactly that on 15020 and
    15021): make the placeholder HTTP/1.1. Process-wide, idempotent; only aiohttp servers are affected."""
    from aiohttp import web_protocol
    from aiohttp.http import HttpVersion11

    placeholder = getattr(web_protocol, "ERROR", None)
    if placeholder is not None and placeholder.version != HttpVersion11:
        web_protocol.ERROR = placeholder._replace(version=HttpVersion11)


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

        _answer_bad_requests_in_http11()
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
