"""The ZDS client: ztunnel's end of the unix socket istio-cni's node agent serves (upstream
``inpod/workloadmanager.rs``).

Connect (SOCK_SEQPACKET) to ``INPOD_UDS``, send ``ZdsHello{V1}``, then answer every request with an ack (a NACK
carries the error). A connection failure or a lost connection is retried with backoff, 10 ms doubling to 15 s,
back to 10 ms once a snapshot has been processed; each new connection starts a new snapshot, and running proxies
stay until it is reconciled. Readiness ("workload proxy manager") is held until a snapshot was processed and no
proxy is pending, and again whenever the connection is lost. A protocol error is NACKed, then ztunnel exits with
status 1, as upstream.

Metrics (unstable, upstream names): ``workload_manager_active_proxy_count``, ``..._pending_proxy_count``,
``..._proxies_started_total``, ``..._proxies_stopped_total``.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Awaitable, Callable

from ztunnel.errors import ZtunnelError
from ztunnel.inpod.protocol import MAX_PACKET, ZdsMessageError, decode_request, encode_ack, encode_hello
from ztunnel.inpod.statemanager import ProtocolError, ProxyStartError, WorkloadProxyManagerState
from ztunnel.metrics import Child, Registry
from ztunnel.readiness import BlockReady, Readiness

log = logging.getLogger("ztunnel.inpod")

INITIAL_BACKOFF = 0.01
MAX_BACKOFF = 15.0
RETRY_PENDING_INTERVAL = 5.0
READINESS_TASK = "workload proxy manager"
_FD_SPACE = socket.CMSG_SPACE(8 * 4)  # room for a few fds, so extra ones are seen (and closed), not truncated


class ZdsConnectionLost(ZtunnelError):
    pass


class WorkloadProxyManager:
    """Runs the ZDS connection and applies its messages to the proxies' state."""

    def __init__(
        self,
        path: str,
        state: WorkloadProxyManagerState,
        readiness: Readiness,
        registry: Registry | None = None,
        on_protocol_error: Callable[[str], None] | None = None,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.path = path
        self.state = state
        self.readiness = readiness
        self._block: BlockReady | None = readiness.register(READINESS_TASK)
        self.on_protocol_error = on_protocol_error
        self.connections = 0
        self.backoff = INITIAL_BACKOFF
        self._sleep = sleep  # the reconnect wait (tests pass a recorder)
        self._sock: socket.socket | None = None
        state.on_change = self._state_changed
        self._gauges: tuple[Child, Child, Child, Child] | None = None
        if registry is not None:
            unstable = "(unstable)"
            self._gauges = (
                registry.family(
                    "workload_manager_active_proxy_count",
                    f"The total number current workloads with active proxies {unstable}",
                    "gauge",
                ).child(),
                registry.family(
                    "workload_manager_pending_proxy_count",
                    f"The total number current workloads with pending proxies {unstable}",
                    "gauge",
                ).child(),
                registry.family(
                    "workload_manager_proxies_started", f"The total number of proxies that were started {unstable}"
                ).child(),
                registry.family(
                    "workload_manager_proxies_stopped", f"The total number of proxies that were stopped {unstable}"
                ).child(),
            )

    def _state_changed(self) -> None:
        st = self.state
        if self._gauges is not None:
            active, pending, started, stopped = self._gauges
            active.value = st.active
            pending.value = len(st.pending)
            started.value = st.started
            stopped.value = st.stopped
        if st.ready:
            # In sync with the agent: the next disconnect starts again at 10 ms (upstream resets its backoff in
            # mark_ready). Not on a bare connect: an agent that accepts and drops us keeps backing off.
            self.backoff = INITIAL_BACKOFF
            if self._block is not None:
                self._block.release()
                self._block = None
        elif self._block is None:
            self._block = self.readiness.register(READINESS_TASK)

    async def run(self) -> None:
        """Connect, serve, reconnect: until cancelled (drain) or a protocol error."""
        retry = asyncio.get_running_loop().create_task(self._retry_pending(), name="inpod retry pending")
        try:
            while True:
                try:
                    await self._serve_once()  # returns only by raising: the connection is lost or broken
                except ProtocolError as e:
                    log.error("ZDS protocol error: %s; exiting", e)
                    if self.on_protocol_error is not None:
                        self.on_protocol_error(str(e))
                    return
                except (OSError, ZdsConnectionLost) as e:
                    log.warning("ZDS connection to %s: %s; retrying in %s", self.path, e, _fmt(self.backoff))
                self.state.reset_snapshot()
                await self._sleep(self.backoff)
                self.backoff = min(self.backoff * 2, MAX_BACKOFF)
        finally:
            retry.cancel()
            if self._sock is not None:
                self._sock.close()

    async def _retry_pending(self) -> None:
        while True:
            await asyncio.sleep(RETRY_PENDING_INTERVAL)
            if self.state.pending:
                await self.state.retry_pending()

    async def _serve_once(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        self._sock = sock
        try:
            await loop.sock_connect(sock, self.path)
            self.connections += 1
            log.info("connected to the node agent at %s", self.path)
            await loop.sock_sendall(sock, encode_hello())
            while True:
                data, fds, flags = await _recv(loop, sock)
                if not data and not fds:
                    raise ZdsConnectionLost("the node agent closed the connection")
                try:
                    msg = decode_request(data, fds, flags)
                    await self.state.process(msg)
                except ZdsMessageError as e:
                    log.warning("bad ZDS message: %s", e)
                    await loop.sock_sendall(sock, encode_ack(str(e)))
                    continue
                except ProxyStartError as e:
                    log.warning("%s", e)
                    await loop.sock_sendall(sock, encode_ack(str(e)))
                    continue
                except ProtocolError as e:
                    with contextlib.suppress(OSError):
                        await loop.sock_sendall(sock, encode_ack(str(e)))
                    raise
                await loop.sock_sendall(sock, encode_ack())
        finally:
            sock.close()
            self._sock = None


async def _recv(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[bytes, list[int], int]:
    """One SEQPACKET packet with the fds of its SCM_RIGHTS (non-blocking recvmsg, woken by the loop)."""
    while True:
        try:
            data, ancdata, flags, _ = sock.recvmsg(MAX_PACKET, _FD_SPACE, socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            await _readable(loop, sock)
            continue
        except OSError as e:
            if e.errno == errno.ECONNRESET:
                raise ZdsConnectionLost("connection reset by the node agent") from None
            raise
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        return data, fds, flags


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await fut
    finally:
        loop.remove_reader(sock.fileno())


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.1f}s"
