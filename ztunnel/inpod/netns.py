"""Network namespaces for in-pod mode: validating the fd istio-cni sends, and creating sockets inside a pod.

As upstream (``inpod/netns.rs::InpodNetns::run``), a socket is created inside a pod's namespace by switching the
calling thread into it with ``setns(2)``, creating the socket, and switching back. The switch is synchronous (no
``await`` in between), so the event loop never runs while the thread is in the pod's namespace, and a socket keeps
the namespace it was created in for its whole life. It costs two system calls (~2 µs) per socket, cheap enough for
the per-connection path; a hop to a helper thread would cost ~50 µs per connection. If switching back ever failed
the process would be in a pod's namespace with no way to tell, so that is fatal (exit 1).

Python 3.11 has no ``os.setns``, so ``setns`` goes through ctypes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import fcntl
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ztunnel.config import SocketAddress
from ztunnel.errors import ZtunnelError
from ztunnel.sockets import SocketConfig, SocketFactory

log = logging.getLogger("ztunnel.inpod")

CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3), <linux/nsfs.h>

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.setns.restype = ctypes.c_int
# Serialises switches: two threads creating pod sockets at once must not interleave their setns calls.
_switch_lock = threading.Lock()


class NetnsError(ZtunnelError, OSError):
    """A namespace fd that is not a network namespace, or a failed switch."""


def setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise NetnsError(err, f"setns({fd}) failed: {os.strerror(err)}")


@dataclass(frozen=True, slots=True)
class NetnsId:
    """A namespace's identity: (device, inode) of its nsfs file. Two fds with the same id are the same namespace."""

    dev: int
    inode: int

    def __str__(self) -> str:
        return f"net:[{self.inode}]"


def netns_id(fd: int) -> NetnsId:
    st = os.fstat(fd)
    return NetnsId(st.st_dev, st.st_ino)


def validate_netns_fd(fd: int) -> None:
    """The fd must be a network namespace (``ioctl(NS_GET_NSTYPE) == CLONE_NEWNET``), as upstream checks."""
    try:
        nstype = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError as e:
        raise NetnsError(e.errno, f"fd {fd} is not a namespace file: {e.strerror}") from None
    if nstype != CLONE_NEWNET:
        raise NetnsError(0, f"fd {fd} is a namespace of type {nstype:#x}, not a network namespace")


class Netns:
    """An open network namespace (owns its fd) and the host namespace to come back to."""

    def __init__(self, fd: int, host_fd: int) -> None:
        validate_netns_fd(fd)
        self.fd = fd
        self.host_fd = host_fd
        self.id = netns_id(fd)

    @classmethod
    def open(cls, path: str, host_fd: int) -> Netns:
        return cls(os.open(path, os.O_RDONLY | os.O_CLOEXEC), host_fd)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block inside this namespace on the calling thread; synchronous code only."""
        with _switch_lock:
            setns(self.fd)
            try:
                yield
            finally:
                try:
                    setns(self.host_fd)
                except OSError as e:  # pragma: no cover - only if the host namespace vanished
                    log.critical("cannot return to ztunnel's own network namespace: %s; exiting", e)
                    sys.stderr.flush()
                    os._exit(1)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __str__(self) -> str:
        return str(self.id)


def host_netns_fd() -> int:
    """An fd for ztunnel's own network namespace, kept open for the process lifetime."""
    return os.open(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/net", os.O_RDONLY | os.O_CLOEXEC)


class InPodSocketFactory(SocketFactory):
    """Creates every socket of one pod's proxies inside the pod's network namespace, marked (SO_MARK 1337)."""

    def __init__(self, cfg: SocketConfig, netns: Netns) -> None:
        # Outbound sockets of a pod leave from the pod's own address: never bind the host's.
        super().__init__(dataclasses.replace(cfg, source_ip=None))
        self.netns = netns

    def tcp(self, family: socket.AddressFamily, *, bind_source: bool = True) -> socket.socket:
        with self.netns.entered():
            return super().tcp(family, bind_source=bind_source)

    def udp(self, family: socket.AddressFamily) -> socket.socket:
        with self.netns.entered():
            return super().udp(family)

    def listeners(
        self, addr: SocketAddress, *, reuse_port: bool = False, transparent: bool | None = False, ipv6: bool = True
    ) -> list[tuple[socket.socket, bool]]:
        with self.netns.entered():
            return super().listeners(addr, reuse_port=reuse_port, transparent=transparent, ipv6=ipv6)

    def udp_listeners(self, addr: SocketAddress, *, reuse_port: bool = False, ipv6: bool = True) -> list[socket.socket]:
        with self.netns.entered():
            return super().udp_listeners(addr, reuse_port=reuse_port, ipv6=ipv6)
