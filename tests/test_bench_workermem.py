"""bench/workermem.py's page classes, checked on a buffer whose writers are known: a forked "worker" and the test
process ("control") each write some of its pages after the fork, a third fork ("witness") writes none."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from bench import workermem

PAGES = 40


def test_the_page_classes() -> None:
    assert workermem.page_class(7, 7, 7) == "shared"
    assert workermem.page_class(7, 8, 7) == "control"
    assert workermem.page_class(8, 7, 7) == "worker"
    assert workermem.page_class(8, 9, 7) == "both"
    assert workermem.page_class(8, 8, 0) == "new"


def test_the_mapping_kinds() -> None:
    assert workermem.kind("[heap]", "rw-p") == "heap"
    assert workermem.kind("", "rw-p") == "anon"
    assert workermem.kind("/usr/lib/libpython3.11.so.1.0", "rw-p") == "so-data"
    assert workermem.kind("/usr/lib/libpython3.11.so.1.0", "r-xp") == "so-text"
    assert workermem.kind("[stack]", "rw-p") == "stack"


def _fork_waiting(then: bytes = b"", buf: mmap.mmap | None = None, first: int = 0, last: int = 0) -> tuple[int, int]:
    """A child that writes ``then`` to pages [first, last) of ``buf``, says so on a pipe, and waits for its end."""
    done_r, done_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(done_r)
            os.close(go_w)
            if buf is not None:
                for page in range(first, last):
                    buf[page * mmap.PAGESIZE] = then[0]
            os.write(done_w, b"x")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(done_w)
    os.close(go_r)
    assert os.read(done_r, 1) == b"x"
    os.close(done_r)
    return pid, go_w


@pytest.mark.skipif(os.geteuid() != 0, reason="page frames in /proc/<pid>/pagemap are for root only")
def test_who_wrote_each_page() -> None:
    buf = mmap.mmap(-1, PAGES * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for page in range(PAGES):  # every page present before the forks
        buf[page * mmap.PAGESIZE] = 1
    children = []
    try:
        witness, w_go = _fork_waiting()
        children.append((witness, w_go))
        worker, k_go = _fork_waiting(b"\x02", buf, 10, 30)  # the worker writes pages 10-29
        children.append((worker, k_go))
        for page in list(range(0, 10)) + list(range(20, 30)):  # the control process writes 0-9 and 20-29
            buf[page * mmap.PAGESIZE] = 3
        view = ctypes.c_char.from_buffer(buf)
        first = ctypes.addressof(view) // mmap.PAGESIZE
        del view  # no export left: the buffer can be closed
        at = first * mmap.PAGESIZE
        classes = workermem.page_classes(worker, os.getpid(), witness, [(at, at + PAGES * mmap.PAGESIZE, "anon")])
        got = [classes[first + page][0] for page in range(PAGES)]
        assert got == ["control"] * 10 + ["worker"] * 10 + ["both"] * 10 + ["shared"] * 10
    finally:
        for pid, go in reversed(children):  # the worker holds a copy of the witness's pipe: it goes first
            os.close(go)
            os.waitpid(pid, 0)
        buf.close()
