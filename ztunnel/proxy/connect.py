"""Dialling plaintext TCP: the one way every listener reaches an app or a non-mesh destination (upstream keeps it
in ``proxy.rs``, ``freebind_connect``).

Outbound uses :func:`connect_plain` for plain TCP to a destination outside the mesh; the inbound listeners (15008
and 15006) use :func:`connect_interruptible`, which a policy change or a forced drain can interrupt while the
connect is still in flight, because their connection is already tracked by then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from ipaddress import ip_address
from typing import Any, Literal

from ztunnel.errors import ZtunnelError
from ztunnel.net import format_addr
from ztunnel.proxy.common import CONNECTION_TIMEOUT, ProxyError, is_timeout, os_error_reason
from ztunnel.proxy.connection_manager import ConnectionRecord
from ztunnel.proxy.relay import PlainConnection
from ztunnel.sockets import (
    SocketFactory,
    connect,
    family_of,
    set_bind_no_port,
    set_freebind,
    set_keepalive,
    set_transparent,
    sockaddr,
    socket_of,
)
from ztunnel.state.workload import IPAddress
from ztunnel.tasks import running_loop

# The access log's error for an inbound connection that a policy change (or a drain) stopped while it connected.
INTERRUPTED = "connection to the app interrupted"


def connect_plain(
    sockets: SocketFactory,
    dst: tuple[IPAddress, int],
    bind_src: IPAddress | None = None,
    transparent: bool = False,
    interrupt: Interrupt | None = None,
) -> Coroutine[Any, Any, PlainConnection]:
    """A plaintext TCP connection to ``dst`` (10 s timeout), optionally from a spoofed source IP: await it.
    ``interrupt`` (:func:`connect_interruptible`) can end the attempt early: then :class:`Interrupted`.

    The one place that chooses how to connect: the event loop's connect when no socket option must precede it
    (:func:`_loop_connect`), else a socket of ours with its options (:func:`_socket_connect`). A plain function
    that returns the chosen coroutine, so the caller awaits that one coroutine and no second one around it (a
    coroutine object, a frame and two resumptions per connection)."""
    if sockets.loop_may_connect():
        local = _loop_local_addr(sockets, bind_src, transparent)
        if local is not False:
            return _loop_connect(running_loop(), sockets, dst, local, interrupt)
    return _socket_connect(sockets, dst, bind_src, transparent, interrupt)


async def _socket_connect(
    sockets: SocketFactory,
    dst: tuple[IPAddress, int],
    bind_src: IPAddress | None,
    transparent: bool,
    interrupt: Interrupt | None,
) -> PlainConnection:
    """:func:`connect_plain` with a socket of ours: options set before the bind (IP_TRANSPARENT, IP_FREEBIND,
    IP_BIND_ADDRESS_NO_PORT, a source IP), then a connect the loop waits on."""
    loop = running_loop()
    try:
        sock = sockets.tcp(family_of(dst[0]), bind_source=bind_src is None)
    except OSError as e:  # EMFILE above all: a clear failure for this connection, not a crashed task
        raise ProxyError(f"failed to connect to {format_addr(*dst)}: {e.strerror or e}") from None
    try:
        if bind_src is not None:
            if bind_src.is_loopback:
                sock.bind(sockaddr(bind_src, 0))  # the app tunnel over loopback (LOCALHOST_APP_TUNNEL)
            elif transparent and set_transparent(sock):
                # Spoof the client's address toward the app, so it sees who really called (IP_TRANSPARENT).
                set_freebind(sock)
                set_bind_no_port(sock)
                sock.bind(sockaddr(bind_src, 0))
            elif sockets.cfg.source_ip is not None and family_of(ip_address(sockets.cfg.source_ip)) == sock.family:
                set_bind_no_port(sock)
                sock.bind((sockets.cfg.source_ip, 0))
        # The timeout is a timer on the loop that ends the wait for the handshake, and an interruption ends it the
        # same way at once: no asyncio.timeout scope, which costs a Timeout, a task lookup and, on Python 3.11, two
        # getpid() system calls (with the running-loop lookups they were 7 getpid per inbound connection).
        await connect(
            sock,
            sockaddr(*dst),
            timeout=CONNECTION_TIMEOUT,
            on_waiting=interrupt.hold if interrupt is not None else None,
        )
        upstream = PlainConnection()
        await loop.create_connection(lambda: upstream, sock=sock)
    except TimeoutError:
        sock.close()
        if interrupt is not None and interrupt.fired:
            raise Interrupted from None
        raise ProxyError(f"connection to {format_addr(*dst)} timed out", timed_out=True) from None
    except OSError as e:
        sock.close()
        raise ProxyError(
            f"failed to connect to {format_addr(*dst)}: {os_error_reason(e)}", timed_out=is_timeout(e)
        ) from None
    except asyncio.CancelledError:
        sock.close()  # the stream this was for went away first
        raise
    return upstream


def _loop_local_addr(
    sockets: SocketFactory, bind_src: IPAddress | None, transparent: bool
) -> tuple[str, int] | Literal[False] | None:
    """The source address the event loop may bind itself (None: none), or False when the socket needs options
    before its bind (IP_TRANSPARENT, IP_FREEBIND, IP_BIND_ADDRESS_NO_PORT), which only the slow path sets."""
    if bind_src is None:
        return False if sockets.cfg.source_ip is not None else None
    if bind_src.is_loopback:
        return sockaddr(bind_src, 0)  # the app tunnel over loopback, bound as connect_plain's own path does
    if transparent or sockets.cfg.source_ip is not None:
        return False
    return None


async def _loop_connect(
    loop: asyncio.AbstractEventLoop,
    sockets: SocketFactory,
    dst: tuple[IPAddress, int],
    local: tuple[str, int] | None,
    interrupt: Interrupt | None,
) -> PlainConnection:
    """:func:`connect_plain` when no option has to precede the connect: the event loop makes, binds and connects
    the socket itself (uvloop: libuv's ``uv_tcp_connect``, numeric addresses resolved in place), and keepalive is
    set once it is connected. Against a socket of ours connected with a writability wait, that is ~6 system calls
    fewer per connection (no ``ioctl``s, no poll handle made and torn down: its ``epoll_ctl`` ADD/DEL probe and
    three DELs, no second TCP_NODELAY) and no future, closures or poll handle in Python."""
    task = asyncio.current_task(loop)  # with the loop given: no running-loop lookup (no getpid on Python 3.11)
    assert task is not None
    state = [False, False]  # [timed out or interrupted, finished]

    def expire() -> None:
        if not state[0] and not state[1]:
            state[0] = True
            task.cancel()

    timer = loop.call_later(CONNECTION_TIMEOUT, expire)
    if interrupt is not None:
        interrupt.hold(expire)
    upstream = PlainConnection()
    host, port = sockaddr(*dst)
    try:
        await loop.create_connection(lambda: upstream, host, port, local_addr=local)
    except asyncio.CancelledError:
        if state[0] and task.uncancel() == 0:
            if interrupt is not None and interrupt.fired:
                raise Interrupted from None
            raise ProxyError(f"connection to {format_addr(*dst)} timed out", timed_out=True) from None
        raise
    except OSError as e:
        raise ProxyError(
            f"failed to connect to {format_addr(*dst)}: {os_error_reason(e)}", timed_out=is_timeout(e)
        ) from None
    finally:
        state[1] = True
        timer.cancel()
    transport = upstream.transport
    if sockets.cfg.keepalive_enabled and transport is not None and not upstream.closed:
        try:
            sock = socket_of(transport)
            try:
                set_keepalive(sock, sockets.cfg)
            finally:
                sock.detach()
        except OSError:
            pass  # closed by the peer already: the relay sees it
    return upstream


class Interrupted(ZtunnelError):
    """A connect ended early by its :class:`Interrupt` (the socket is closed)."""


class Interrupt:
    """A ``closer`` for a connection still connecting: ends the wait for the handshake at once, as an
    interruption rather than a timeout."""

    __slots__ = ("fired", "wake")

    def __init__(self) -> None:
        self.fired = False
        self.wake: Callable[[], None] | None = None  # ends the connect's wait (sockets.connect's on_waiting)

    def hold(self, wake: Callable[[], None]) -> None:
        self.wake = wake
        if self.fired:
            wake()

    def __call__(self, reason: str) -> None:
        self.fired = True
        if self.wake is not None:
            self.wake()  # the wait ends with TimeoutError, which connect_plain reads as this interruption


async def connect_interruptible(
    sockets: SocketFactory,
    record: ConnectionRecord,
    dst: tuple[IPAddress, int],
    bind_src: IPAddress | None,
    transparent: bool,
) -> PlainConnection | None:
    """:func:`connect_plain` for a connection already tracked (``record``), which the connection manager can
    interrupt through ``record.closer`` (a policy change that denies it, a forced drain): then None, with the
    half-open socket closed, and ``record.forced`` says why. Raises ProxyError when the connect fails."""
    upstream: PlainConnection | None = None
    interrupt = Interrupt()
    record.closer = interrupt
    try:
        upstream = await connect_plain(sockets, dst, bind_src, transparent, interrupt)
    except Interrupted:
        pass  # it closed its socket
    finally:
        record.closer = None
    if record.forced is not None and upstream is not None:
        upstream.close()  # interrupted just as the connect completed
        return None
    return upstream
