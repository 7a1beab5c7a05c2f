"""istio-cni's side of ZDS: the server ztunnel connects to in in-pod mode, on a SOCK_SEQPACKET unix socket.

ztunnel connects, says ``ZdsHello{V1}``, gets a snapshot (one ``add`` per known pod, carrying the pod's netns fd in
``SCM_RIGHTS``, or ``keep`` when the netns is gone), then ``SnapshotSent``; afterwards ``add``/``del`` as pods come
and go. Every message waits for ztunnel's ``WorkloadResponse{ack}`` (5 s, as the CNI); a non-empty ``ack.error`` is a
NACK. As the CNI, adds go to the newest connection and deletes to all of them, so during a rolling restart the old
ztunnel still hears about deleted pods. :class:`ZdsServer` is that server; the messages are encoded and decoded by
the ZDS codec both sides share (:mod:`ztunnel.inpod.protocol`), and with ``apply_rules`` it applies the in-pod rules
(:mod:`ztunnel.standins.cni.rules`) to each pod before announcing it, as istio-cni does.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ztunnel.config import WorkloadInfo
from ztunnel.errors import ZtunnelError
from ztunnel.inpod.protocol import (
    ZdsMessageError,
    decode_ack,
    decode_hello,
    encode_add,
    encode_del,
    encode_keep,
    encode_snapshot_sent,
)
from ztunnel.standins.cni.rules import apply_inpod_rules, netns_path, remove_inpod_rules
from ztunnel.tasks import TaskGroup

log = logging.getLogger("ztunnel.standins.cni.server")

DEFAULT_SOCKET = "/var/run/ztunnel/ztunnel.sock"  # ztunnel's INPOD_UDS default
ACK_TIMEOUT = 5.0  # the CNI's read/write deadline per message
# ztunnel reads into a 1024-byte buffer; its acks are a few bytes. A larger read buffer lets us see (and reject)
# a message that would have been truncated, instead of mis-parsing it.
_RECV_BUFFER = 4096


@dataclass(frozen=True, slots=True)
class PodInfo:
    """A pod as the node agent knows it: ZDS identity plus its network namespace (name or path)."""

    uid: str
    namespace: str
    name: str
    service_account: str = "default"
    netns: str = ""

    @property
    def netns_path(self) -> Path:
        return netns_path(self.netns)

    @property
    def workload_info(self) -> WorkloadInfo:
        return WorkloadInfo(name=self.name, namespace=self.namespace, service_account=self.service_account)

    @classmethod
    def parse(cls, spec: str) -> PodInfo:
        """``UID:NAMESPACE/NAME[/SERVICE_ACCOUNT]:NETNS`` (NETNS is a name under /run/netns or a path)."""
        parts = spec.split(":", 2)
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"pod {spec!r}: expected UID:NAMESPACE/NAME/SERVICE_ACCOUNT:NETNS")
        uid, ident, netns = parts
        names = ident.split("/")
        if len(names) not in (2, 3) or not all(names):
            raise ValueError(f"pod {spec!r}: expected NAMESPACE/NAME or NAMESPACE/NAME/SERVICE_ACCOUNT, got {ident!r}")
        sa = names[2] if len(names) == 3 else "default"
        return cls(uid=uid, namespace=names[0], name=names[1], service_account=sa, netns=netns)


class ZdsError(ZtunnelError, RuntimeError):
    """The ztunnel connection failed: no ack in time, a malformed message, or the connection closed."""


class ZdsNotConnected(ZdsError):
    """No ztunnel is connected. The pod is still recorded and goes out in the next connection's snapshot."""


def _check_hello(data: bytes) -> None:
    try:
        decode_hello(data)
    except ZdsMessageError as e:
        raise ZdsError(str(e)) from None


def _ack_error(data: bytes) -> str:
    try:
        return decode_ack(data)
    except ZdsMessageError as e:
        raise ZdsError(str(e)) from None


# --------------------------------------------------------------------------------------------------------------
# ZDS server (the CNI side)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request and its answer, kept in :attr:`ZdsServer.history` for tests and the demo."""

    connection: int
    kind: str  # "add", "keep", "del", "snapshot_sent"
    uid: str
    error: str  # ack.error: "" for an ack


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Connection:
    """One ztunnel connection. A reader callback delivers each packet to the one outstanding request (hello or
    ack); any other packet, or EOF, closes the connection, as the CNI's keepalive read does."""

    def __init__(self, sock: socket.socket, ident: int, on_closed: Callable[[_Connection], None]) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.id = ident
        self.loop = asyncio.get_running_loop()
        # One message in flight at a time; API requests also wait for `synced` (the snapshot acked, or closed).
        self.lock = asyncio.Lock()
        self.synced = asyncio.Event()
        self.closed = False
        self.close_reason = ""
        self._on_closed = on_closed
        self._writable: asyncio.Future[None] | None = None
        # The hello may arrive before the handshake task runs, so the first "request" is armed right away.
        self._pending: asyncio.Future[bytes] | None = self.loop.create_future()
        self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        try:
            data, ancdata, flags, _ = self.sock.recvmsg(_RECV_BUFFER, socket.CMSG_SPACE(16 * 4))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.close(f"read failed: {e}")
            return
        for level, kind, payload in ancdata:  # ztunnel never sends fds; never leak them
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                for fd in fds:
                    os.close(fd)
        if not data:
            self.close("ztunnel closed the connection")
        elif flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            self.close("truncated message from ztunnel")
        elif self._pending is None or self._pending.done():
            self.close(f"unsolicited message from ztunnel ({len(data)} bytes)")
        else:
            self._pending.set_result(data)

    async def _send(self, data: bytes, fds: Sequence[int]) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while True:
            if self.closed:
                raise ZdsError(f"connection {self.id} closed: {self.close_reason}")
            try:
                self.sock.sendmsg([data], anc)
                return
            except (BlockingIOError, InterruptedError):
                self._writable = writable = self.loop.create_future()
                self.loop.add_writer(self.fd, _resolve, writable)
                try:
                    await writable
                finally:
                    self._writable = None
                    if not self.closed:
                        self.loop.remove_writer(self.fd)

    async def receive(self, timeout: float) -> bytes:
        """The next packet (the armed one first)."""
        if self.closed:
            raise ZdsError(f"connection {self.id} closed: {self.close_reason}")
        if self._pending is None:
            self._pending = self.loop.create_future()
        try:
            return await asyncio.wait_for(self._pending, timeout)
        except TimeoutError:
            self.close(f"no message from ztunnel within {timeout:g} s")
            raise ZdsError(f"connection {self.id}: no message from ztunnel within {timeout:g} s") from None
        finally:
            self._pending = None

    async def request(self, data: bytes, fds: Sequence[int], timeout: float) -> str:
        """Send one request and wait for its ack; returns ack.error. The caller holds :attr:`lock`."""
        if self.closed:
            raise ZdsError(f"connection {self.id} closed: {self.close_reason}")
        self._pending = self.loop.create_future()
        try:
            await asyncio.wait_for(self._send(data, fds), timeout)
        except (OSError, TimeoutError) as e:
            reason = f"send failed: {e or 'timed out'}"
            self.close(reason)
            raise ZdsError(f"connection {self.id}: {reason}") from e
        try:
            return _ack_error(await self.receive(timeout))
        except ZdsError as e:
            self.close(str(e))
            raise

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        log.info("ztunnel connection %d closed: %s", self.id, reason)
        self.loop.remove_reader(self.fd)
        if self._writable is not None:
            self.loop.remove_writer(self.fd)
            _resolve(self._writable)  # _send sees `closed`
        self.sock.close()
        if self._pending is not None and not self._pending.done():
            self._pending.set_exception(ZdsError(f"connection {self.id} closed: {reason}"))
            self._pending.exception()  # marked retrieved: nobody may be waiting
        self.synced.set()  # wake API callers; they find the connection closed
        self._on_closed(self)


@dataclass
class _Counters:
    connections: int = 0
    snapshots: int = 0
    history: list[Exchange] = field(default_factory=list)


class ZdsServer:
    """The CNI side of ZDS on a SOCK_SEQPACKET unix socket at ``path``.

    ``pods`` are known from the start and go out in every connection's snapshot; :meth:`add_pod` and
    :meth:`del_pod` change the set and tell the connected ztunnel(s). With ``apply_rules`` the in-pod rules are
    applied to a pod's netns before ztunnel hears of it (at :meth:`start` for the initial pods) and removed after
    its delete, as istio-cni does.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        pods: Iterable[PodInfo] = (),
        *,
        ack_timeout: float = ACK_TIMEOUT,
        apply_rules: bool = False,
        dns_capture: bool = False,
        ipv6: bool = True,
    ) -> None:
        self.path = Path(path)
        self.pods: dict[str, PodInfo] = {p.uid: p for p in pods}
        self.ack_timeout = ack_timeout
        self.apply_rules = apply_rules
        self.dns_capture = dns_capture
        self.ipv6 = ipv6
        self._listener: socket.socket | None = None
        self._conns: list[_Connection] = []  # oldest first
        self._counters = _Counters()
        self._changed: asyncio.Event | None = None  # set and replaced on every state change
        self._tasks = TaskGroup("nodeagent")

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> ZdsServer:
        if self.apply_rules:
            for pod in self.pods.values():
                if pod.netns_path.exists():  # a gone pod is announced with `keep`; nothing to redirect
                    await asyncio.to_thread(apply_inpod_rules, pod.netns_path, self.dns_capture, self.ipv6)
        self._changed = asyncio.Event()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a stale socket from an earlier run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(str(self.path))
            sock.listen(16)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)
        log.info("ZDS server listening on %s with %d pod(s)", self.path, len(self.pods))
        return self

    async def stop(self) -> None:
        """Stop listening and close every connection (ztunnel sees EOF and reconnects with backoff)."""
        if self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        for conn in list(self._conns):
            conn.close("node agent stopped")
        await self._tasks.cancel_all(timeout=5)

    async def __aenter__(self) -> ZdsServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- state for callers ----------------------------------------------------------------------------------------

    @property
    def connected(self) -> int:
        """Live ztunnel connections (including ones still receiving their snapshot)."""
        return len(self._conns)

    @property
    def snapshots(self) -> int:
        """Snapshots completed (SnapshotSent acked) since start, over all connections."""
        return self._counters.snapshots

    @property
    def history(self) -> list[Exchange]:
        return self._counters.history

    async def wait_snapshot(self, count: int = 1, timeout: float = 10.0) -> None:
        """Wait until ``count`` snapshots have completed since start (i.e. the count-th ztunnel is in sync)."""
        await self._wait(lambda: self._counters.snapshots >= count, timeout)

    async def wait_disconnected(self, timeout: float = 10.0) -> None:
        """Wait until no ztunnel is connected."""
        await self._wait(lambda: not self._conns, timeout)

    async def _wait(self, pred: Callable[[], bool], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not pred():
                assert self._changed is not None, "start() first"
                await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # -- API --------------------------------------------------------------------------------------------------------

    async def add_pod(self, pod: PodInfo) -> str:
        """Record ``pod`` and announce it to the newest ztunnel; returns "" on ack, else the NACK reason.

        Raises :class:`ZdsNotConnected` when no ztunnel is connected (the pod still goes out in the next snapshot),
        :class:`ZdsError` when the connection fails or the netns cannot be opened, :class:`InpodRulesError` when
        ``apply_rules`` is set and the rules cannot be applied.
        """
        if self.apply_rules:
            await asyncio.to_thread(apply_inpod_rules, pod.netns_path, self.dns_capture, self.ipv6)
        self.pods[pod.uid] = pod
        if not self._conns:
            raise ZdsNotConnected(f"pod {pod.uid} recorded, but no ztunnel is connected to {self.path}")
        conn = self._conns[-1]
        await conn.synced.wait()
        async with conn.lock:
            try:
                fd = os.open(pod.netns_path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise ZdsError(f"pod {pod.uid}: cannot open netns {pod.netns_path}: {e}") from e
            try:
                return await self._exchange(conn, "add", pod.uid, encode_add(pod.uid, pod.workload_info), [fd])
            finally:
                os.close(fd)

    async def del_pod(self, uid: str) -> str:
        """Forget the pod and tell every connected ztunnel; returns "" when all acked (or none is connected), else
        the NACK reasons joined by "; ". Raises :class:`ZdsError` if a connection failed."""
        pod = self.pods.pop(uid, None)

        async def one(conn: _Connection) -> str:
            await conn.synced.wait()
            async with conn.lock:
                return await self._exchange(conn, "del", uid, encode_del(uid), [])

        results = await asyncio.gather(*(one(c) for c in list(self._conns)), return_exceptions=True)
        if self.apply_rules and pod is not None and pod.netns_path.exists():
            await asyncio.to_thread(remove_inpod_rules, pod.netns_path, self.ipv6)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise ZdsError("; ".join(str(f) for f in failures))
        return "; ".join(r for r in results if isinstance(r, str) and r)

    # -- connections ---------------------------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.warning("accept on %s failed: %s", self.path, e)
            return
        sock.setblocking(False)
        self._counters.connections += 1
        conn = _Connection(sock, self._counters.connections, self._closed)
        self._conns.append(conn)
        log.info("ztunnel connection %d accepted", conn.id)
        self._notify()
        self._tasks.spawn(self._handshake(conn), f"conn-{conn.id}")

    def _closed(self, conn: _Connection) -> None:
        with contextlib.suppress(ValueError):
            self._conns.remove(conn)
        self._notify()

    async def _handshake(self, conn: _Connection) -> None:
        # API requests wait for `conn.synced`, so until the snapshot is acked only this task talks to ztunnel.
        try:
            _check_hello(await conn.receive(self.ack_timeout))
            snapshot = list(self.pods.values())
            for pod in snapshot:
                try:
                    fd = os.open(pod.netns_path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as e:
                    log.info("pod %s: netns %s unavailable (%s); sending keep", pod.uid, pod.netns_path, e)
                    await self._exchange(conn, "keep", pod.uid, encode_keep(pod.uid), [])
                    continue
                try:
                    await self._exchange(conn, "add", pod.uid, encode_add(pod.uid, pod.workload_info), [fd])
                finally:
                    os.close(fd)
            await self._exchange(conn, "snapshot_sent", "", encode_snapshot_sent(), [])
            self._counters.snapshots += 1
            log.info("ztunnel connection %d: snapshot of %d pod(s) acked", conn.id, len(snapshot))
            self._notify()
        except ZdsError as e:
            conn.close(str(e))
        finally:
            conn.synced.set()

    async def _exchange(self, conn: _Connection, kind: str, uid: str, data: bytes, fds: Sequence[int]) -> str:
        error = await conn.request(data, fds, self.ack_timeout)
        self._counters.history.append(Exchange(conn.id, kind, uid, error))
        if error:
            log.warning("ztunnel connection %d NACKed %s %s: %s", conn.id, kind, uid, error)
        return error
