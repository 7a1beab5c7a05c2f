"""The control <-> worker channel on an asyncio loop: the codec of :mod:`ztunnel.workers.protocol` over one end of a
unix stream ``socketpair``, fds beside the bytes (``SCM_RIGHTS``).

Thin on purpose: reads feed the decoder, answers resolve the waiting :meth:`Channel.call`, everything else goes to
the owner's handler; writes go out at once and what the socket does not take waits in a queue for writability. The
queue is bounded (:data:`MAX_QUEUED`): a peer that stops reading (stopped, wedged) is cut off rather than allowed
to grow the other side's memory; the control process then restarts that worker with a fresh snapshot.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from ztunnel.errors import ZtunnelError
from ztunnel.workers.protocol import (
    MAX_FDS,
    ChannelError,
    Decoder,
    Message,
    Request,
    RequestIds,
    Response,
    describe,
    encode,
)

log = logging.getLogger("ztunnel.workers")

READ_SIZE = 1 << 20
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
# What may wait unsent for a peer that does not read: a snapshot of a big mesh (~8 MiB) plus a burst of deltas
# fits many times over.
MAX_QUEUED = 256 << 20

R = TypeVar("R", bound=Response)


class ChannelClosed(ZtunnelError, ConnectionError):
    """The other process is gone (or the channel was closed): no answer will come."""


Handler = Callable[[Message, list[int]], None]


class Channel:
    """One end of a worker's channel, on the running loop. ``handler(msg, fds)`` gets every message that is not an
    answer, in order; it owns the fds. ``on_close(reason)`` is called once when the channel ends."""

    def __init__(self, sock: socket.socket, handler: Handler, on_close: Callable[[str], None], name: str) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.name = name
        self._handler = handler
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()
        self._decoder = Decoder()
        self._out: deque[tuple[memoryview, list[int]]] = deque()  # frames not fully sent, and their (dup'd) fds
        self._queued = 0
        self._writing = False
        self._empty = asyncio.Event()  # nothing queued
        self._empty.set()
        self._pending: dict[int, asyncio.Future[Response]] = {}
        self._ids = RequestIds()
        self.closed = False
        self.close_reason = ""
        self._loop.add_reader(sock.fileno(), self._readable)

    # -- sending -------------------------------------------------------------------------------------------------

    def send(self, msg: Message, fds: Sequence[int] = ()) -> None:
        """Queue ``msg`` (with ``fds``, which stay the caller's: the channel sends copies). Raises
        :class:`ChannelClosed` when the channel has ended."""
        self.send_frame(encode(msg, len(fds)), fds)

    def send_frame(self, frame: bytes, fds: Sequence[int] = ()) -> None:
        """Queue a frame already encoded (one encoding for every worker: a delta goes to all of them)."""
        if self.closed:
            raise ChannelClosed(f"{self.name}: channel closed ({self.close_reason})")
        self._out.append((memoryview(frame), [os.dup(fd) for fd in fds]))
        self._queued += len(frame)
        self._empty.clear()
        if self._queued > MAX_QUEUED:
            self.close(f"the peer stopped reading ({self._queued} bytes waiting)")
            raise ChannelClosed(f"{self.name}: {self.close_reason}")
        if not self._writing:
            self._flush()

    async def call(self, request: Request, fds: Sequence[int] = (), response: type[R] = Response) -> R:  # type: ignore[assignment]
        """Send ``request`` (numbered here) and wait for its answer. Raises :class:`ChannelClosed` if the channel
        ends first, :class:`ChannelError` if the answer is not a ``response``."""
        return await self.request(request, fds, response)

    def request(self, request: Request, fds: Sequence[int] = (), response: type[R] = Response) -> Awaitable[R]:  # type: ignore[assignment]
        """Send ``request`` now (its ``fds`` are copied before this returns, so the caller may close them) and
        return what waits for its answer, as :meth:`call` does. Raises :class:`ChannelClosed` at once when the
        channel has ended."""
        request.request_id = self._ids.next()
        fut: asyncio.Future[Response] = self._loop.create_future()
        self._pending[request.request_id] = fut
        try:
            self.send(request, fds)
        except BaseException:
            self._pending.pop(request.request_id, None)
            raise
        return self._answer(request, fut, response)

    async def _answer(self, request: Request, fut: asyncio.Future[Response], response: type[R]) -> R:
        try:
            answer = await fut
        finally:
            self._pending.pop(request.request_id, None)
        if not isinstance(answer, response):
            raise ChannelError(f"{self.name}: {describe(request)} was answered by {describe(answer)}")
        return answer

    def _flush(self) -> None:
        while self._out:
            view, fds = self._out[0]
            try:
                if fds:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    n = self.sock.sendmsg([view], anc)
                    _close_all(fds)  # the kernel has its own references now, attached to this frame's first byte
                    fds.clear()
                else:
                    n = self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.close(f"write failed: {e}")
                return
            self._queued -= n
            if n == len(view):
                self._out.popleft()
            else:
                self._out[0] = (view[n:], fds)
        want = bool(self._out)
        if not want:
            self._empty.set()
        if want != self._writing:
            self._writing = want
            if want:
                self._loop.add_writer(self.sock.fileno(), self._flush)
            else:
                self._loop.remove_writer(self.sock.fileno())

    # -- receiving -----------------------------------------------------------------------------------------------

    def _readable(self) -> None:
        try:
            data, anc, flags, _ = self.sock.recvmsg(READ_SIZE, _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.close(f"read failed: {e}")
            return
        fds: list[int] = []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        if flags & socket.MSG_CTRUNC:
            _close_all(fds)
            self.close("ancillary data was cut (more fds than expected)")
            return
        if not data:
            _close_all(fds)
            cut = self._decoder.pending
            self.close("the peer closed the channel" + (f" mid-frame ({cut} bytes of a frame)" if cut else ""))
            return
        try:
            messages = self._decoder.feed(data, fds)
        except ChannelError as e:
            self.close(str(e))
            return
        for msg, msg_fds in messages:
            if isinstance(msg, Response):
                fut = self._pending.get(msg.request_id)
                _close_all(msg_fds)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                continue
            try:
                self._handler(msg, msg_fds)
            except Exception:  # one message failing must not stop the ones after it
                log.exception("%s: handling %s failed", self.name, describe(msg))
            if self.closed:
                return

    # -- closing -------------------------------------------------------------------------------------------------

    def close(self, reason: str = "closed") -> None:
        """End the channel (idempotent): waiting calls fail with :class:`ChannelClosed`, queued frames are dropped."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        fd = self.sock.fileno()
        if fd >= 0:
            self._loop.remove_reader(fd)
            if self._writing:
                self._loop.remove_writer(fd)
        self._writing = False
        for _, fds in self._out:
            _close_all(fds)
        self._out.clear()
        self._empty.set()
        self._decoder.close()
        self.sock.close()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ChannelClosed(f"{self.name}: {reason}"))
        self._pending.clear()
        self._on_close(reason)

    async def drained(self) -> None:
        """Wait until every queued frame was handed to the kernel (or the channel closed)."""
        await self._empty.wait()


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
