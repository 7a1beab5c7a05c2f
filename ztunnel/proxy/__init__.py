"""The data plane: one :class:`Proxy` per proxied workload, with a module per listener, named as upstream's.

Listeners (none imports another): ``outbound`` (15001), ``inbound`` (15008, HBONE), ``inbound_passthrough``
(15006) and ``socks5`` (15080), on the shared ``listener`` base and given ``inputs`` (``ProxyInputs``). Below them:
the HBONE connection ``pool``, the plaintext dial (``connect``), the ``relay``, the ``connection_manager`` (access
log, policy re-checks) and ``metrics``, ``common`` (errors and response flags, headers), and the ``hbone`` package
(the sans-IO HTTP/2 CONNECT core and its TLS adapter).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ztunnel.net import format_addr
from ztunnel.proxy.connection_manager import CLOSED_FROM_DRAIN, Authorizer, PolicyWatcher
from ztunnel.proxy.inbound import Inbound
from ztunnel.proxy.inbound_passthrough import InboundPassthrough
from ztunnel.proxy.inputs import ProxyInputs
from ztunnel.proxy.outbound import Outbound
from ztunnel.proxy.socks5 import Socks5

log = logging.getLogger("ztunnel.proxy")


class Proxy:
    """The listeners of one proxied workload, sharing one pool and one connection manager."""

    def __init__(self, pi: ProxyInputs) -> None:
        self.pi = pi
        authorize = Authorizer(pi.state, pi.config.authz_policy_info_logging)
        self.policy_watcher = PolicyWatcher(pi.state, pi.connections, authorize)
        self.outbound = Outbound(pi)
        self.inbound = Inbound(pi, authorize)
        self.inbound_passthrough = InboundPassthrough(pi, authorize)
        self.socks5 = Socks5(pi, self.outbound.proxy_to) if pi.config.socks5_enabled else None

    async def start(self, serve: bool = True) -> None:
        """Bind every listener, accepting at once with ``serve`` (else from :meth:`serve` on, as upstream's accept
        loops wait for the first xDS sync); on failure nothing stays bound."""
        try:
            await self.inbound.start(serve)
            await self.inbound_passthrough.start(serve)
            await self.outbound.start(serve)
            if self.socks5 is not None:
                await self.socks5.start(serve)
        except BaseException:
            self.stop_listening()
            raise
        self.policy_watcher.start()
        log.info(
            "proxy listening: outbound %s, inbound %s, inbound plaintext %s%s",
            format_addr(*self.outbound.address),
            format_addr(*self.inbound.address),
            format_addr(*self.inbound_passthrough.address),
            f", socks5 {format_addr(*self.socks5.address)}" if self.socks5 is not None else "",
        )

    async def serve(self) -> None:
        """Start accepting on every listener bound by :meth:`start`."""
        for listener in (self.inbound, self.inbound_passthrough, self.outbound, self.socks5):
            if listener is not None:
                await listener.serve()

    def stop_listening(self) -> None:
        for listener in (self.outbound, self.inbound, self.inbound_passthrough, self.socks5):
            if listener is not None:
                listener.stop()

    def drain(self) -> None:
        """Stop accepting; ask HBONE peers to move on (GOAWAY); open connections may finish."""
        self.policy_watcher.stop()
        self.stop_listening()
        self.inbound.drain()
        self.pi.pool.close()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every tracked connection and every inbound HBONE connection closed (one without streams closes
        once its peer answered the drain GOAWAY's PING: a CONNECT that crossed the GOAWAY is served first); False if
        some were still open at ``timeout``, or the drain was forced first (a second SIGINT: "exit immediately" must
        not sit out the rest of the deadline)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        drain = self.pi.drain
        inbound = self.inbound.connections
        while len(self.pi.connections) or len(self.pi.tasks) or inbound:
            left = deadline - loop.time()
            if left <= 0 or drain.forced:
                return False
            # Poll the (cheap) counts every 50 ms, but wake at once when the drain is forced.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drain.wait_forced(), min(left, 0.05))
        return True

    def force_close(self, reason: str = CLOSED_FROM_DRAIN) -> None:
        self.pi.connections.close_all(reason)
        self.pi.pool.abort(reason)
        for conn in list(self.inbound.connections):
            conn.abort(reason)


__all__ = ["Proxy", "ProxyInputs"]
