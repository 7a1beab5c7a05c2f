"""What the four listeners share: binding their address, reporting it, and stopping (upstream binds each in the
listener's ``new`` and serves it in ``run``)."""

from __future__ import annotations

import abc
import asyncio

from ztunnel.config import SocketAddress
from ztunnel.proxy.inputs import ProxyInputs


class Listener(abc.ABC):
    """One listening address of a proxy, served by the protocol :meth:`new_protocol` makes for each connection.

    ``captured`` listeners receive the workload's redirected traffic (15001, 15006, 15008): in-pod they share their
    port with the pod's other ztunnel generation (``INPOD_PORT_REUSE``), and with ``ENABLE_ORIG_SRC`` they are made
    transparent so the inbound side can connect to the app from the client's address. SOCKS5 (15080) is neither.
    """

    def __init__(self, pi: ProxyInputs, addr: SocketAddress | None, *, captured: bool = True) -> None:
        self.pi = pi
        self.bind_addr = addr
        self.captured = captured
        self.servers: list[asyncio.Server] = []
        # IP_TRANSPARENT took on a socket: the listener may spoof the client's address toward the app. Only the
        # inbound listeners read it; outbound never spoofs.
        self.transparent = False

    @abc.abstractmethod
    def new_protocol(self) -> asyncio.BaseProtocol:
        """The protocol for one accepted connection."""

    async def start(self, serve: bool = True) -> None:
        """Bind every address of the listener (``localhost``: both families) and, with ``serve``, start accepting
        (else connections wait in the backlog until :meth:`serve`)."""
        cfg = self.pi.config
        addr = self.bind_addr
        if addr is None:
            raise ValueError(f"{type(self).__name__}: no address to listen on")
        if self.captured:
            socks = self.pi.sockets.listeners(
                addr, reuse_port=cfg.inpod_port_reuse, transparent=cfg.enable_orig_src, ipv6=cfg.ipv6_enabled
            )
        else:
            socks = self.pi.sockets.listeners(addr, ipv6=cfg.ipv6_enabled)
        loop = asyncio.get_running_loop()
        for sock, transparent in socks:
            self.transparent = self.transparent or transparent
            self.servers.append(await loop.create_server(self.new_protocol, sock=sock, start_serving=serve))

    async def serve(self) -> None:
        """Start accepting on every bound address (a no-op where it already does, or was closed meanwhile)."""
        for server in self.servers:
            if server.sockets and not server.is_serving():
                await server.start_serving()

    @property
    def address(self) -> tuple[str, int]:
        """The first bound address (the port the OS chose, for port 0)."""
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return str(host), int(port)

    def stop(self) -> None:
        """Stop accepting; connections already accepted carry on."""
        for s in self.servers:
            s.close()
