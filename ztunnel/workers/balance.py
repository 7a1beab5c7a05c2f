"""Spreading the inbound HBONE connections (15008) of one ztunnel over its worker processes.

Why: every worker binds 15008 with ``SO_REUSEPORT`` and the kernel hashes each new connection's addresses to one of
them. That spreads many connections well, but 15008 gets few: a peer node pools its HBONE connections (one per
peer worker and identity pair, up to 100 streams each), so between two nodes with 2 workers each, node B receives 2
long-lived connections, both on one worker half of the time, and that worker then carries every stream while the
other idles (measured: the server node's smallest worker CPU share was 0.00 in 3 of 3 benchmark repetitions).
Upstream runs the streams of one connection on any thread of its runtime; processes cannot share a TLS connection,
so the balance is made per connection, when it is accepted.

How:

- The **load board** (:class:`LoadBoard`): a few bytes of memory shared by the control process and every worker (a
  ``memfd`` the control process creates and passes to each worker with its ``Start``). Slot *i* holds worker *i*'s
  count of open inbound HBONE connections, written by that worker alone whenever the count changes (one store to
  memory: no message, no system call), and whether worker *i* takes connections, written by the control process
  alone (set when the worker is ready; cleared when it exits, loses its channel or drains).
- Each accept on 15008 asks :func:`choose` (pure): with ``own`` open connections here and the least loaded serving
  worker at ``least`` (its board count plus the connections already on their way to it from here), the connection
  is handed to that worker when ``own - least >= MARGIN``, i.e. when keeping it would leave this worker two or more
  connections above the least loaded one; otherwise it stays. A balanced worker (the common case) pays a read of
  the board, per accept, and nothing else.
- A connection to hand on is passed before a byte of it is read (before the TLS handshake starts): the worker
  sends the accepted socket to the control process (``SCM_RIGHTS`` over its channel, :class:`~ztunnel.workers.
  protocol.HandOff`), which passes it to the target (:class:`~ztunnel.workers.protocol.HandIn`); the target serves
  it as if it had accepted it. The control process relays the fd, never a byte.
- Never twice: a worker serves a connection it was handed without asking :func:`choose`, so no socket moves more
  than once (no ping-pong however stale a count is).
- Never lost: the control process keeps its copy of the socket until a worker acknowledged taking it, which a
  worker does before reading from it. If the target refuses (it is draining, or lacks the pod) or dies before
  acknowledging, the socket goes back to the worker that accepted it (or, if that one is gone too, to any other),
  which serves it: nothing was read from it, so the client's handshake simply proceeds there.

Only 15008: the outbound (15001), inbound plaintext (15006) and SOCKS5 (15080) listeners get many short connections,
which the kernel's hash spreads well.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

from ztunnel.tasks import TaskGroup
from ztunnel.workers import protocol as p

if TYPE_CHECKING:
    from ztunnel.workers.channel import Channel

log = logging.getLogger("ztunnel.workers")

# Hand a connection on when this worker has at least MARGIN more open connections than the least loaded one: with
# 1, two connections never share a worker while another has none, and counts stay within 1 of each other. A
# connection moves only when keeping it would widen the gap to 2 or more, so a balanced ztunnel moves none.
MARGIN = 1
_SLOT = 8  # bytes per value: a signed 64-bit integer ("q"), written and read whole


def choose(me: int, own: int, counts: Sequence[int], up: Sequence[int], pending: Sequence[int]) -> int | None:
    """The worker to hand a connection just accepted by worker ``me`` to, or None to keep it. Pure.

    ``own`` is ``me``'s count of open inbound HBONE connections (before this one); ``counts[i]`` worker *i*'s as the
    board says, ``up[i]`` nonzero when worker *i* takes connections, ``pending[i]`` the connections ``me`` handed to
    worker *i* that it has not acknowledged yet (counted as its own: a burst of accepts must not all go to the worker
    that looked least loaded before the burst). Ties go to the lowest index.
    """
    best: int | None = None
    least = own - MARGIN + 1  # a candidate must be at most own - MARGIN
    for i in range(len(counts)):
        if i == me or not up[i]:
            continue
        load = counts[i] + pending[i]
        if load < least:
            best, least = i, load
    return best


class LoadBoard:
    """``size`` workers' slots in shared memory: ``counts[i]`` (open inbound HBONE connections, written by worker *i*)
    and ``up[i]`` (1 when worker *i* takes connections, written by the control process). Each value has one writer;
    a reader may see a value a moment late, which only makes one decision slightly off."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._map = mmap.mmap(fd, 2 * size * _SLOT)
        view = memoryview(self._map).cast("q")
        self.counts = view[:size]
        self.up = view[size:]

    @classmethod
    def create(cls, size: int) -> LoadBoard:
        """A new board of ``size`` slots, all zero (the control process's)."""
        fd = os.memfd_create("ztunnel-load", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 2 * size * _SLOT)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> LoadBoard:
        """The board whose fd came with ``Start`` (a worker's); takes the fd."""
        try:
            size = os.fstat(fd).st_size // (2 * _SLOT)
            if size <= 0:
                raise ValueError(f"load board fd {fd} is {size * 2 * _SLOT} bytes")
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    def set_up(self, index: int, up: bool) -> None:
        self.up[index] = 1 if up else 0

    def forget(self, index: int) -> None:
        """Worker ``index`` is gone: it takes nothing and holds nothing (its replacement starts at 0)."""
        self.up[index] = 0
        self.counts[index] = 0

    def close(self) -> None:
        self.counts.release()
        self.up.release()
        self._map.close()
        os.close(self.fd)


class WorkerBalance:
    """One worker's side of the balance: its count on the board, the decision at each accept, and the handoffs it
    has in flight. :meth:`bind` gives each proxy (the dedicated one, or each pod's) the
    :class:`~ztunnel.proxy.inputs.InboundBalance` its 15008 listener calls."""

    def __init__(self, index: int, board: LoadBoard, channel: Channel) -> None:
        if not 0 <= index < board.size:
            raise ValueError(f"worker {index} has no slot on a load board of {board.size}")
        self.index = index
        self.board = board
        self.channel = channel
        self.count = 0  # open inbound HBONE connections served here, over every proxy of this worker
        self.pending = [0] * board.size  # handed to worker i, not acknowledged yet
        self.tasks = TaskGroup("handoffs")
        board.counts[index] = 0

    def bind(self, key: p.ProxyKey | None) -> BoundBalance:
        """The balance of one proxy's 15008 listener: ``key`` names the proxy in the target worker (None: the
        dedicated proxy; in-pod: the pod)."""
        return BoundBalance(self, key)

    def pick(self) -> int | None:
        if not self.count:
            return None  # nothing is below 0: the idle worker's accept costs one test
        board = self.board
        return choose(self.index, self.count, board.counts, board.up, self.pending)

    def opened(self) -> None:
        self.count += 1
        self.board.counts[self.index] = self.count

    def closed(self) -> None:
        self.count -= 1
        self.board.counts[self.index] = self.count

    def hand_off(self, fd: int, target: int, key: p.ProxyKey | None) -> None:
        """Send the accepted socket ``fd`` to worker ``target`` through the control process (the channel sends a
        copy at once: the caller closes ``fd`` when this returns). Raises ChannelClosed when the channel is gone."""
        self.pending[target] += 1
        try:
            waiting = self.channel.request(p.HandOff(target, key), [fd], p.Ack)
        except BaseException:
            self.pending[target] -= 1
            raise
        self.tasks.spawn(self._answered(target, waiting), f"handoff to {target}")

    async def _answered(self, target: int, waiting: Awaitable[p.Ack]) -> None:
        try:
            ack = await waiting
            if ack.error is not None:
                log.debug("worker %d: inbound connection not taken by worker %d: %s", self.index, target, ack.error)
        except Exception as e:  # the channel ended: this worker is exiting anyway
            log.debug("worker %d: handoff to worker %d not answered: %s", self.index, target, e)
        finally:
            self.pending[target] -= 1


class BoundBalance:
    """:class:`WorkerBalance` for one proxy (see :meth:`WorkerBalance.bind`)."""

    __slots__ = ("balance", "closed", "key", "opened", "pick")

    def __init__(self, balance: WorkerBalance, key: p.ProxyKey | None) -> None:
        self.balance = balance
        self.key = key
        # The per-accept calls go straight to the worker's object.
        self.pick = balance.pick
        self.opened = balance.opened
        self.closed = balance.closed

    def hand_off(self, fd: int, target: int) -> None:
        self.balance.hand_off(fd, target, self.key)


__all__ = ["MARGIN", "BoundBalance", "LoadBoard", "WorkerBalance", "choose"]
