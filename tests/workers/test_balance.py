"""The balance of inbound HBONE connections over workers, without processes: the pure decision (:func:`choose`) and
the shared load board (two mappings of one memfd, as the control process and a worker hold it)."""

from __future__ import annotations

import os

import pytest

from ztunnel.workers.balance import MARGIN, LoadBoard, choose


def test_margin_is_one() -> None:
    # The cases below are written for it: a worker hands on when it has at least one more than the least loaded.
    assert MARGIN == 1


@pytest.mark.parametrize(
    ("me", "own", "counts", "up", "pending", "expected"),
    [
        # The case that motivated it: a second long-lived connection on the worker that has the first, none on the
        # other: it moves.
        (0, 1, [1, 0], [1, 1], [0, 0], 1),
        # Balanced: kept (it only ever moves when keeping it would leave a gap of 2 or more).
        (0, 0, [0, 0], [1, 1], [0, 0], None),
        (0, 1, [1, 1], [1, 1], [0, 0], None),
        (1, 5, [4, 5], [1, 1], [0, 0], 0),  # 5 here, 4 there: 5 - 4 >= 1, the new one goes to worker 0
        (1, 4, [5, 4], [1, 1], [0, 0], None),  # the least loaded worker itself keeps everything
        # A worker that does not take connections (starting, exited, draining) is never chosen, however idle.
        (0, 3, [3, 0], [1, 0], [0, 0], None),
        # The least loaded of several, ties to the lowest index; never itself.
        (2, 3, [2, 1, 3, 1], [1, 1, 1, 1], [0, 0, 0, 0], 1),
        (0, 2, [2, 2, 2], [1, 1, 1], [0, 0, 0], None),
        # Connections on their way count as the target's: a burst of accepts is spread, not all sent to the
        # worker that looked idle before it.
        (0, 1, [1, 0], [1, 1], [0, 1], None),
        (0, 2, [2, 0, 0], [1, 1, 1], [0, 1, 0], 2),
        (0, 3, [3, 0], [1, 1], [0, 2], 1),
        (0, 2, [2, 0], [1, 1], [0, 2], None),
        # Its own slot on the board is not read (``own`` is the worker's exact count).
        (0, 0, [9, 0], [1, 1], [0, 0], None),
    ],
)
def test_choose(me: int, own: int, counts: list[int], up: list[int], pending: list[int], expected: int | None) -> None:
    assert choose(me, own, counts, up, pending) == expected


def test_a_burst_on_one_worker_is_split_evenly() -> None:
    """8 connections accepted at once by worker 0 of 2, before worker 1 took any of those handed to it: what
    pending does."""
    own, pending = 0, [0, 0]
    for _ in range(8):
        target = choose(0, own, [own, 0], [1, 1], pending)
        if target is None:
            own += 1
        else:
            pending[target] += 1
    assert (own, pending[1]) == (4, 4)


def test_board_is_shared_between_mappings() -> None:
    control = LoadBoard.create(3)
    worker = LoadBoard.attach(os.dup(control.fd))  # what a worker maps from the fd that came with its Start
    try:
        assert worker.size == 3
        assert list(worker.counts) == [0, 0, 0] and list(worker.up) == [0, 0, 0]
        control.set_up(1, True)
        worker.counts[1] = 7
        assert list(worker.up) == [0, 1, 0]
        assert list(control.counts) == [0, 7, 0]
        control.forget(1)  # worker 1 exited
        assert list(worker.counts) == [0, 0, 0] and list(worker.up) == [0, 0, 0]
    finally:
        worker.close()
        control.close()


def test_attach_refuses_what_is_not_a_board() -> None:
    fd = os.memfd_create("empty")
    with pytest.raises(ValueError, match="load board fd"):
        LoadBoard.attach(fd)
    with pytest.raises(OSError):
        os.fstat(fd)  # taken: closed on failure too
