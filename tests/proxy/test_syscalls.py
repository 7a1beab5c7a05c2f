"""System calls per connection of real ztunnel processes, counted by ``strace -c`` (exact counts, unlike CPU time):
two ``python -m ztunnel`` nodes on loopback, 60 connections of SOCKS5 + 1-byte echo + close through node A (SOCKS5
accept, pooled HBONE out) and node B (HBONE in, a new connection to the app). The table these counts come from is in
``bench/README.md`` (``python -m ztunnel.testing.syscalls``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ztunnel.testing.syscalls import parse_strace_c, per_connection_table, strace_path

N = 60

pytestmark = pytest.mark.skipif(strace_path() is None, reason="strace is not installed (apt-get install strace)")


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, float]]]:
    workdir: Path = tmp_path_factory.mktemp("syscalls")
    try:
        yield per_connection_table(N, workdir)
    except PermissionError as e:  # ptrace refused (a container without CAP_SYS_PTRACE)
        pytest.skip(f"strace cannot attach here: {e}")


def test_the_counts_are_of_the_connections(table: dict[str, dict[str, float]]) -> None:
    """Anchors, so no bound below passes by measuring nothing (strace attached to the wrong process, or detached
    before the connections ran): node A accepts each SOCKS5 connection once and shuts each down once, node B makes
    one socket and one connect to the app per connection."""
    a, b = table["a"], table["b"]
    assert 0.95 <= a.get("accept4", 0) <= 1.05, a
    assert 0.95 <= a.get("shutdown", 0) <= 1.05, a
    assert 0.95 <= b.get("socket", 0) <= 1.05, b
    assert 0.95 <= b.get("connect", 0) <= 1.05, b


def test_no_getpid_per_connection(table: dict[str, dict[str, float]]) -> None:
    """CPython 3.11's running-loop lookups (asyncio.get_running_loop, create_task, asyncio.timeout, Event() ...)
    and LogRecord's process id each call getpid(), a real system call: 3 per connection on node A and 7 on node B
    before. What is left are the loop's own periodic timers (a few per second, whatever the connection count)."""
    assert table["a"].get("getpid", 0) < 0.25, table["a"]
    assert table["b"].get("getpid", 0) < 0.25, table["b"]


def test_accepted_socket_costs(table: dict[str, dict[str, float]]) -> None:
    """Node A's SOCKS5 accept: TCP_NODELAY once (the transport sets it; ours was a second one), the addresses read
    once by the transport and not again through its socket object, and no getrlimit per accept (it was 2, 4, 2
    and 1 per connection)."""
    a = table["a"]
    assert a.get("setsockopt", 0) <= 1.05, a
    assert a.get("getsockname", 0) <= 2.05, a
    assert a.get("getpeername", 0) <= 1.05, a
    assert a.get("prlimit64", 0) < 0.1, a


def test_connected_socket_costs(table: dict[str, dict[str, float]]) -> None:
    """Node B's connect to the app, made and connected by the event loop (libuv) with keepalive set after: no
    ioctl, one epoll_ctl (the DEL at close; the rest are batched through io_uring), TCP_NODELAY once (libuv's),
    SO_REUSEADDR (libuv's bind of the loopback source here), the four keepalive options. Our own socket connected
    with a writability wait cost 4 ioctls, 7 epoll_ctls and a second TCP_NODELAY per connection."""
    b = table["b"]
    assert b.get("ioctl", 0) < 0.05, b
    assert b.get("epoll_ctl", 0) <= 1.05, b
    assert b.get("setsockopt", 0) <= 6.05, b
    assert b.get("getpid", 0) < 0.25, b


def test_parse_strace_c() -> None:
    """The summary parser reads calls with and without an errors column, and leaves the total out."""
    text = """% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 40.00    0.000400           2       200           getpid
 30.00    0.000300           1       180        60 epoll_ctl
------ ----------- ----------- --------- --------- ----------------
100.00    0.000700           1       380        60 total
"""
    assert parse_strace_c(text) == {"getpid": 200, "epoll_ctl": 180}
