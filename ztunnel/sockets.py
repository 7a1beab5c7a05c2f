"""Socket options ztunnel needs, as upstream's ``socket.rs`` sets them.

``SO_ORIGINAL_DST`` (the pre-REDIRECT destination), ``IP_TRANSPARENT``/``IP_FREEBIND`` (source-IP spoofing toward
the app), ``SO_MARK`` (so the pod's iptables rules skip ztunnel's own traffic), TCP keepalive (180 s / 180 s / 9, so
idle tunnels outlive middlebox timeouts) and ``TCP_NODELAY`` on every accepted socket.

A :class:`SocketFactory` creates every socket a proxy uses; the in-pod variant creates them inside a pod's network
namespace with the mark set, so listeners and outbound connections live in the pod.
"""

from __future__ import annotations

import _socket
import asyncio
import contextlib
import errno
import functools
import ipaddress
import logging
import os
import resource
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ztunnel.config import Config, SocketAddress
from ztunnel.errors import ZtunnelError
from ztunnel.net import format_addr
from ztunnel.state.workload import IPAddress, canonical_ip
from ztunnel.tasks import running_loop

SOL_IP = 0
SOL_IPV6 = 41
SO_ORIGINAL_DST = 80  # netfilter: <linux/netfilter_ipv4.h>
IP6T_SO_ORIGINAL_DST = 80  # <linux/netfilter_ipv6/ip6_tables.h>
IP_TRANSPARENT = 19
IPV6_TRANSPARENT = 75
IP_FREEBIND = 15
IP_BIND_ADDRESS_NO_PORT = 24  # same value for IPv6 sockets (it is an IP-level option that covers both)
SO_MARK = 36
TCP_USER_TIMEOUT = 18
LISTEN_BACKLOG = 128  # as upstream's in-pod listeners; the kernel caps it at somaxconn anyway

log = logging.getLogger("ztunnel.sockets")


@dataclass(frozen=True, slots=True)
class SocketConfig:
    keepalive_enabled: bool = True
    keepalive_time: float = 180.0
    keepalive_interval: float = 180.0
    keepalive_retries: int = 9
    user_timeout_enabled: bool = False
    mark: int | None = None
    # Outbound connections leave from this IP when set: a node bound to one address of a multi-address host (the
    # loopback demo's 127.0.1.1) is then seen by peers under that address, as a real node would be.
    source_ip: str | None = None
    # Every listener sets SO_REUSEPORT, whatever its caller asks: each worker process binds the same addresses and
    # the kernel spreads the connections (and DNS datagrams) over them.
    reuse_port: bool = False

    @classmethod
    def from_config(cls, cfg: Config) -> SocketConfig:
        return cls(
            keepalive_enabled=cfg.keepalive_enabled,
            keepalive_time=cfg.keepalive_time,
            keepalive_interval=cfg.keepalive_interval,
            keepalive_retries=cfg.keepalive_retries,
            user_timeout_enabled=cfg.user_timeout_enabled,
            mark=cfg.packet_mark,
            source_ip=_specific_ip(cfg.outbound_addr),
        )


def _specific_ip(addr: SocketAddress) -> str | None:
    if addr.is_localhost:
        return None
    ip = ipaddress.ip_address(addr.host)
    return None if ip.is_unspecified else str(ip)


@functools.lru_cache(maxsize=1024)
def ipv4_from_packed(packed: bytes) -> ipaddress.IPv4Address:
    """The address of 4 packed bytes, cached: the same few destinations come back on every connection (SOCKS5
    requests, iptables' original destinations), addresses are immutable values, and ipaddress's constructor is 3
    Python calls."""
    return ipaddress.IPv4Address(packed)


def original_dst(sock: _socket.socket) -> tuple[IPAddress, int] | None:
    """The destination the client dialled before an iptables REDIRECT, or None when there was none."""
    try:
        if sock.family == socket.AF_INET6:
            raw = sock.getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST, 28)
            port = struct.unpack_from("!H", raw, 2)[0]
            ip: IPAddress = ipaddress.IPv6Address(raw[8:24])
        else:
            raw = sock.getsockopt(SOL_IP, SO_ORIGINAL_DST, 16)
            port = struct.unpack_from("!H", raw, 2)[0]
            ip = ipv4_from_packed(raw[4:8])
    except OSError:
        if sock.family == socket.AF_INET6:
            # A v4 connection on a dual-stack socket: try the v4 option too.
            try:
                raw = sock.getsockopt(SOL_IP, SO_ORIGINAL_DST, 16)
            except OSError:
                return None
            return ipv4_from_packed(raw[4:8]), struct.unpack_from("!H", raw, 2)[0]
        return None
    return canonical_ip(ip), port


@functools.lru_cache(maxsize=4096)
def _parsed_ip(host: str) -> IPAddress:
    # The same few peer and local addresses come back on every connection, and parsing one with ipaddress (and
    # canonicalising ::ffff:a.b.c.d) was ~4 % of a ztunnel's CPU per new connection (py-spy, connection-rate loop).
    # Addresses are immutable values, so a bounded cache of them is safe to share.
    return canonical_ip(ipaddress.ip_address(host))


def parsed_address(address: Sequence[Any]) -> tuple[IPAddress, int]:
    """``(ip, port)`` of an address as sockets and transports give it (``peername``, ``sockname``; IPv6 adds flow
    and scope), the IP parsed once per distinct address and canonical (``::ffff:a.b.c.d`` as IPv4)."""
    return _parsed_ip(address[0]), address[1]


def transport_peer(transport: asyncio.BaseTransport) -> tuple[IPAddress, int]:
    """The peer of a connected transport, from the address the transport kept when it was made (uvloop and asyncio
    both read it once then): no ``getpeername`` per use, as through the transport's socket object (uvloop's
    stand-in socket pays a ``getsockname`` to build a socket object, then the call itself)."""
    return parsed_address(transport.get_extra_info("peername"))


def transport_local(transport: asyncio.BaseTransport) -> tuple[IPAddress, int]:
    """The transport's own address: the original destination under TPROXY (no NAT happened), as
    :func:`transport_peer`."""
    return parsed_address(transport.get_extra_info("sockname"))


def socket_of(transport: asyncio.BaseTransport) -> _socket.socket:
    """A socket object for the transport's descriptor, to set or read several options with one object; the caller
    detaches it when done (``sock.detach()`` in a ``finally``), leaving the descriptor to the transport.

    uvloop hands out a stand-in whose every ``setsockopt``/``getsockopt`` builds a new socket object first (a
    ``getsockname`` each: four keepalive options cost eight system calls); this builds one. It is the C socket type
    with the family read from the address the transport kept (2 fields for IPv4, 4 for IPv6): no system call, and
    none of the stand-in's or ``socket.socket``'s Python-level work (family and type converted to enums, a context
    manager), 9 Python calls per connection before.
    """
    sockname = transport.get_extra_info("sockname")
    stand_in = transport.get_extra_info("socket")
    if sockname is not None and isinstance(sockname, tuple):
        family = socket.AF_INET6 if len(sockname) == 4 else socket.AF_INET
    else:
        family = stand_in.family
    return _socket.socket(family, socket.SOCK_STREAM, 0, stand_in.fileno())


def accepted_destination(transport: asyncio.BaseTransport, cfg: SocketConfig) -> tuple[IPAddress, int]:
    """A captured connection (15001, 15006): its keepalive options set, and the destination the client dialled
    (iptables' original destination, else the listener's own address), with one socket object that is detached
    whatever happens, so the descriptor stays the transport's."""
    sock = socket_of(transport)
    try:
        set_accepted_options(sock, cfg, keepalive=True)
        return original_dst(sock) or transport_local(transport)
    finally:
        sock.detach()


def accepted_addresses(
    transport: asyncio.BaseTransport, cfg: SocketConfig
) -> tuple[tuple[IPAddress, int], tuple[IPAddress, int]] | None:
    """A captured connection's (source, destination) (:func:`accepted_destination`, :func:`transport_peer`), or
    None, the transport aborted, for a client that reset before the listener ran for it: its transport kept no peer
    address (and its socket may refuse the options)."""
    try:
        dst = accepted_destination(transport, cfg)
        return transport_peer(transport), dst
    except (TypeError, OSError):
        transport.abort()  # type: ignore[attr-defined]  # every accepted transport is a Transport
        return None


def set_accepted_options(sock: _socket.socket, cfg: SocketConfig, keepalive: bool) -> None:
    """15001/15006 accepted sockets get keepalive (``socket.rs::Listener::accept``); every accepted socket is where
    running out of file descriptors is noticed (:class:`FdHeadroom`).

    TCP_NODELAY, which upstream sets on every accepted socket, is not set here: uvloop (``TCPTransport.new``) and
    asyncio (``_SelectorSocketTransport``) set it on every TCP transport they make, so doing it again was one
    ``setsockopt`` (and, through uvloop's stand-in socket, one ``getsockname``) per connection for nothing
    (``tests/test_sockets.py`` checks the option on accepted and connected sockets).
    """
    fd_headroom.check(sock.fileno())
    if keepalive:
        set_keepalive(sock, cfg)


class FdHeadroom:
    """Says once when accepted sockets are about to exhaust ``RLIMIT_NOFILE``, and once when there is room again.

    When no descriptor is left, ``accept`` fails with EMFILE and uvloop (libuv) copes on its own, silently: it closes
    a descriptor it keeps in reserve, accepts every waiting connection and closes it at once (the clients see their
    connection closed), then takes the reserve back. No error reaches ztunnel and the loop does not spin, so without
    this the only sign would be clients failing. The kernel hands out the lowest free descriptor, so an accepted
    socket numbered within :data:`HEADROOM` of the limit means all the ones below are taken: a check per accept,
    against the limit read again for every new highest descriptor and at most a second ago otherwise (it can
    change at run time: ``prlimit``). Recovery is confirmed by counting the
    open descriptors, at most once a second.
    """

    HEADROOM = 32  # descriptors; an eighth of the limit when that is less (a test's tiny limit)
    # The limit is read again whenever an accepted descriptor is the highest since the last read (the only way
    # towards exhaustion), and otherwise at most once a second (a limit changed at run time while the descriptor
    # numbers stay put): a getrlimit per accept was one of the ~68 system calls per connection in the self-loop
    # (strace -c), where the same few descriptor numbers come back on every connection.
    LIMIT_TTL = 1.0

    def __init__(self) -> None:
        self.exhausted = False
        self._checked = 0.0
        self._soft = -1  # the soft limit last read; -1: none yet
        self._high = -1  # the highest descriptor checked since it was read
        self._read_at = 0.0

    def _limit(self, fd: int) -> int:
        now = time.monotonic()
        if fd > self._high or now - self._read_at >= self.LIMIT_TTL:
            self._soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self._high = fd
            self._read_at = now
        return self._soft

    def check(self, fd: int) -> None:
        soft = self._limit(fd)
        if soft == resource.RLIM_INFINITY:
            return
        headroom = min(self.HEADROOM, soft // 8)
        if fd >= soft - headroom:
            if not self.exhausted:
                self.exhausted = True
                log.warning(
                    "running out of file descriptors: accepted a connection as fd %d, RLIMIT_NOFILE is %d; when none "
                    "are left new connections are closed as soon as they are accepted, until others close "
                    "(raise the limit: LimitNOFILE, ulimit -n)",
                    fd,
                    soft,
                )
        elif self.exhausted and time.monotonic() - self._checked >= 1.0:
            self._checked = time.monotonic()
            try:
                in_use = len(os.listdir("/proc/self/fd"))
            except OSError:  # no descriptor left even to look
                return
            if in_use < soft - 2 * headroom:
                self.exhausted = False
                log.info("file descriptors available again: %d of %d in use", in_use, soft)


fd_headroom = FdHeadroom()  # the limit is per process


def set_keepalive(sock: _socket.socket, cfg: SocketConfig) -> None:
    if not cfg.keepalive_enabled:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(cfg.keepalive_time)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(cfg.keepalive_interval)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, cfg.keepalive_retries))
    if cfg.user_timeout_enabled:
        # Upstream: time + retries * interval, so the two mechanisms give up together.
        ms = int((cfg.keepalive_time + cfg.keepalive_retries * cfg.keepalive_interval) * 1000)
        sock.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, ms)


def set_mark(sock: socket.socket, mark: int | None) -> None:
    if mark is not None:
        sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)


class TransparentError(ZtunnelError, OSError):
    """``ENABLE_ORIG_SRC=true`` and a listener cannot be made transparent; the message says which and why."""


def set_transparent(sock: socket.socket) -> bool:
    """IP_TRANSPARENT (needs CAP_NET_ADMIN). Returns whether it took; failure is normal outside a pod."""
    try:
        _set_transparent(sock)
    except OSError:
        return False
    return True


def _set_transparent(sock: socket.socket) -> None:
    if sock.family == socket.AF_INET6:
        sock.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
    else:
        sock.setsockopt(SOL_IP, IP_TRANSPARENT, 1)


def set_freebind(sock: socket.socket) -> None:
    if sock.family == socket.AF_INET6:
        sock.setsockopt(SOL_IPV6, 78, 1)  # IPV6_FREEBIND
    else:
        sock.setsockopt(SOL_IP, IP_FREEBIND, 1)


def set_bind_no_port(sock: socket.socket) -> None:
    """Bind the source address only, leaving the port to ``connect``.

    ``bind(ip, 0)`` reserves a port for every destination at once, searching the bind table for one that is free.
    When the client closes first, ztunnel's spoofed upstream sockets are the ones left in TIME_WAIT, and with
    20,000 of them a bind took ~800 µs of CPU instead of ~60 µs (measured on these machines) and eventually fails
    with EADDRINUSE. Deferred to ``connect``, the port only has to be unique for its 4-tuple (Linux 4.2+; best
    effort before).
    """
    with contextlib.suppress(OSError):
        sock.setsockopt(SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)


def family_of(ip: IPAddress) -> socket.AddressFamily:
    return socket.AF_INET6 if ip.version == 6 else socket.AF_INET


def sockaddr(ip: IPAddress, port: int) -> tuple[str, int]:
    return (str(ip), port)


async def connect(
    sock: socket.socket,
    address: tuple[str, int],
    *,
    timeout: float | None = None,
    on_waiting: Callable[[Callable[[], None]], None] | None = None,
) -> None:
    """Connect a non-blocking socket to a numeric ``address``, waiting for the handshake on the event loop.

    ``loop.sock_connect`` in uvloop resolves every address through ``getaddrinfo`` on its thread pool, even a
    numeric one: 96 us of CPU per connection against 48 us for this (connect, then wait for writability), measured
    on these machines, plus a thread wake-up each time. Raises OSError with the socket's error, as ``connect`` does.

    ``timeout`` (seconds) ends the wait with TimeoutError: a timer on the loop rather than an ``asyncio.timeout``
    scope, which on Python 3.11 costs a task lookup and two ``getpid`` system calls per connection. ``on_waiting``
    is handed the function that ends the wait the same way at once (an interruption), once there is a wait.
    """
    err = sock.connect_ex(address)
    if err == errno.EINPROGRESS:
        loop = running_loop()
        done = loop.create_future()
        fd = sock.fileno()

        def writable() -> None:
            if not done.done():
                done.set_result(None)

        def expire() -> None:
            if not done.done():
                done.set_exception(TimeoutError())

        loop.add_writer(fd, writable)
        timer = loop.call_later(timeout, expire) if timeout is not None else None
        if on_waiting is not None:
            on_waiting(expire)
        try:
            await done
        finally:
            loop.remove_writer(fd)
            if timer is not None:
                timer.cancel()
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, os.strerror(err))


class SocketFactory:
    """Creates the sockets a proxy uses. Subclassed by in-pod mode to create them inside a pod's namespace."""

    def __init__(self, cfg: SocketConfig) -> None:
        self.cfg = cfg

    def loop_may_connect(self) -> bool:
        """Whether the event loop may make and connect an outbound socket itself: no option is needed before the
        connect (SO_MARK), and the sockets are not made specially (in-pod mode makes them in the pod's network
        namespace, by overriding :meth:`tcp`)."""
        return self.cfg.mark is None and type(self).tcp is SocketFactory.tcp

    def tcp(self, family: socket.AddressFamily, *, bind_source: bool = True) -> socket.socket:
        """An unconnected, non-blocking TCP socket for an outbound connection (marked, keepalive on).

        ``bind_source=False`` leaves it unbound, for a caller that binds a (spoofed) source address itself.
        """
        # Non-blocking from the start (no ioctl after), and no TCP_NODELAY: the transport made on the connected
        # socket sets it (uvloop's TCPTransport and asyncio's both do), and every caller makes one.
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            set_mark(sock, self.cfg.mark)
            set_keepalive(sock, self.cfg)
            src = self.cfg.source_ip
            if bind_source and src is not None and family_of(ipaddress.ip_address(src)) == family:
                set_bind_no_port(sock)
                sock.bind((src, 0))
        except BaseException:
            sock.close()
            raise
        return sock

    def listeners(
        self, addr: SocketAddress, *, reuse_port: bool = False, transparent: bool | None = False, ipv6: bool = True
    ) -> list[tuple[socket.socket, bool]]:
        """Bound, listening sockets for ``addr`` with whether IP_TRANSPARENT took. ``localhost`` gives two.

        ``transparent`` is ``ENABLE_ORIG_SRC``'s tri-state (upstream ``maybe_set_transparent``): ``None`` tries
        IP_TRANSPARENT and goes on without it (best effort), ``True`` requires it (:class:`TransparentError`
        otherwise), ``False`` never sets it, so the proxy never spoofs the client's address toward the app.
        """
        hosts = [addr.host]
        if addr.is_localhost:
            hosts = ["127.0.0.1", "::1"] if ipv6 and socket.has_ipv6 else ["127.0.0.1"]
        out: list[tuple[socket.socket, bool]] = []
        try:
            for host in hosts:
                ip = ipaddress.ip_address(host)
                try:
                    out.append(self._listener(ip, addr.port, reuse_port=reuse_port, transparent=transparent))
                except OSError:
                    if host == "::1" and addr.is_localhost:
                        continue  # IPv6 disabled on loopback: bind v4 only, as upstream does
                    raise
                if addr.port == 0 and addr.is_localhost:
                    # Bind the second address family to the same port the first one got.
                    addr = SocketAddress("localhost", out[0][0].getsockname()[1])
        except BaseException:
            for s, _ in out:
                s.close()
            raise
        return out

    def _listener(
        self, ip: IPAddress, port: int, *, reuse_port: bool, transparent: bool | None
    ) -> tuple[socket.socket, bool]:
        family = family_of(ip)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port or self.cfg.reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                # [::] accepts IPv4 too (dual stack), as upstream's listeners do.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if ip == ipaddress.IPv6Address("::") else 1)
            set_mark(sock, self.cfg.mark)
            is_transparent = False
            if transparent is None:
                is_transparent = set_transparent(sock)
            elif transparent:
                try:
                    _set_transparent(sock)
                except OSError as e:
                    where = format_addr(ip, port)
                    raise TransparentError(
                        f"ENABLE_ORIG_SRC=true, but the listener {where} cannot be made transparent (IP_TRANSPARENT): "
                        f"{e} (it needs CAP_NET_ADMIN; unset ENABLE_ORIG_SRC for best effort, or set it to false)"
                    ) from None
                is_transparent = True
            sock.bind(sockaddr(ip, port))
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock, is_transparent

    def udp(self, family: socket.AddressFamily) -> socket.socket:
        """An unbound, non-blocking UDP socket for an outbound datagram exchange (the DNS proxy's upstream queries).

        Marked like every other pod socket, so the pod's DNS capture rule (``--dport 53 ! --mark``) lets it out.
        """
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            set_mark(sock, self.cfg.mark)
        except BaseException:
            sock.close()
            raise
        return sock

    def udp_listeners(self, addr: SocketAddress, *, reuse_port: bool = False, ipv6: bool = True) -> list[socket.socket]:
        """Bound UDP sockets for ``addr`` (the DNS proxy). ``localhost`` gives 127.0.0.1 and, if it exists, ::1.

        No ``SO_REUSEADDR``: on UDP it would let a second process silently share the port.
        """
        hosts = [addr.host]
        if addr.is_localhost:
            hosts = ["127.0.0.1", "::1"] if ipv6 and socket.has_ipv6 else ["127.0.0.1"]
        out: list[socket.socket] = []
        port = addr.port
        try:
            for host in hosts:
                ip = ipaddress.ip_address(host)
                try:
                    out.append(self._udp_listener(ip, port, reuse_port=reuse_port))
                except OSError:
                    if host == "::1" and addr.is_localhost:
                        continue  # IPv6 disabled on loopback: v4 only, as upstream
                    raise
                if port == 0 and addr.is_localhost:
                    port = out[0].getsockname()[1]
        except BaseException:
            for s in out:
                s.close()
            raise
        return out

    def _udp_listener(self, ip: IPAddress, port: int, *, reuse_port: bool) -> socket.socket:
        family = family_of(ip)
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            if reuse_port or self.cfg.reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if ip == ipaddress.IPv6Address("::") else 1)
            set_mark(sock, self.cfg.mark)
            sock.bind(sockaddr(ip, port))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock
