"""Inbound plaintext (port 15006): captured non-HBONE connections to the pod, policy-checked and passed through.

Upstream ``proxy/inbound_passthrough.rs``: the original destination comes from ``SO_ORIGINAL_DST``; a destination
port that is one of ztunnel's own is refused; the local workload must be known (waiting up to 5 s for xDS, as
upstream); policy sees no identity (the traffic is plaintext); a denial simply closes the connection, also when the
denying policy arrives while the app is being connected to. Metrics report ``connection_security_policy=unknown``
and the destination service guessed from the destination port (the workload's services, by target port).
"""

from __future__ import annotations

import asyncio
import logging

from ztunnel.proxy.common import ProxyError, ResponseFlag, guess_inbound_service, services_of
from ztunnel.proxy.connect import INTERRUPTED, connect_interruptible
from ztunnel.proxy.connection_manager import AuthorizeFn, ConnectionRecord, Direction, log_failed
from ztunnel.proxy.inputs import ProxyInputs
from ztunnel.proxy.listener import Listener
from ztunnel.proxy.metrics import OpenSocket
from ztunnel.proxy.relay import PlainConnection, PlainRelay
from ztunnel.rbac import Connection
from ztunnel.sockets import accepted_addresses
from ztunnel.state.workload import IPAddress, NetworkAddress

log = logging.getLogger("ztunnel.proxy.inbound_passthrough")


class InboundPassthrough(Listener):
    """The 15006 listener of one proxy."""

    def __init__(self, pi: ProxyInputs, authorize: AuthorizeFn) -> None:
        super().__init__(pi, pi.config.inbound_plaintext_addr)
        self.authorize = authorize

    def new_protocol(self) -> PlainConnection:
        return PlainConnection(self._accepted)

    def _accepted(self, plain: PlainConnection) -> None:
        assert plain.transport is not None
        plain.on_lost = OpenSocket(self.pi.connections.traffic, "destination").closed
        addresses = accepted_addresses(plain.transport, self.pi.sockets.cfg)
        if addresses is None:  # reset before it was served
            return
        src, dst = addresses
        self.pi.tasks.spawn(self._proxy(plain, src, dst), "inbound passthrough")

    async def _proxy(self, plain: PlainConnection, src: tuple[IPAddress, int], dst: tuple[IPAddress, int]) -> None:
        pi = self.pi
        if dst[1] in pi.config.illegal_ports:
            plain.close()
            log_failed(Direction.INBOUND, src, dst, "attempted recursive call to ourselves")
            return
        try:
            # As upstream, wait (up to 5 s) for the pod's workload to show up in xDS: it may lag the pod.
            local = await pi.local.get()
        except ProxyError as e:
            plain.close()
            log_failed(Direction.INBOUND, src, dst, str(e))
            return
        record = ConnectionRecord(
            direction=Direction.INBOUND,
            src=src,
            dst=dst,
            src_workload=pi.state.workloads.find_address(NetworkAddress(pi.config.network, src[0])),
            dst_workload=local,
            dst_service=guess_inbound_service(services_of(pi.state, local), None, dst[1], local),
        )
        record.rbac = Connection(src[0], src[1], dst[0], dst[1], None, pi.config.network)
        # Tracked from before the policy check (upstream's assert_rbac): a policy that arrives while the app is being
        # connected to reaches this connection too.
        pi.connections.register(record, established=False)
        denied = self.authorize(record.rbac, local)
        if denied is not None:
            plain.close()
            pi.connections.release(record, ResponseFlag.DENY, f"connection closed due to policy rejection: {denied}")
            return
        spoof = src[0] if self.transparent and src[0] != dst[0] else None
        try:
            upstream = await connect_interruptible(pi.sockets, record, dst, spoof, self.transparent)
        except ProxyError as e:
            plain.close()
            pi.connections.release(record, e.flag, str(e))
            return
        except asyncio.CancelledError:
            plain.close()
            pi.connections.release(record, ResponseFlag.CONNECT, "closed before the connection to the app")
            raise
        if upstream is None:
            # Denied (or drained) while connecting: never let it through. The log reports record.forced.
            plain.close()
            pi.connections.release(record, ResponseFlag.CONNECT, INTERRUPTED)
            return
        record.bytes_sent = lambda: upstream.bytes_read
        record.bytes_recv = lambda: upstream.bytes_written
        relay = PlainRelay(
            plain, upstream, on_done=lambda r: pi.connections.release(record, ResponseFlag.NONE, r.error)
        )
        record.closer = lambda reason: relay.reset()
        pi.connections.established(record)
        relay.start()
