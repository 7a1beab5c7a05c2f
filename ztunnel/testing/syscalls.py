"""System calls per connection of a running ztunnel, counted by ``strace -c`` (noise-free, unlike CPU time).

:class:`SyscallCounter` attaches ``strace -f -c`` to a process (all its threads) while a block of work runs, and
returns the number of calls per system call name. :func:`per_connection_table` runs ``n`` SOCKS5 connections
(1-byte echo, close) through a :class:`ztunnel.testing.TwoNodeMesh` of two ``python -m ztunnel`` processes and
returns each node's counts divided by ``n``: node A carries the SOCKS5 accept and the outbound HBONE connect,
node B the HBONE accept and the connect to the app. Used by ``tests/proxy/test_syscalls.py`` and
``python -m ztunnel.testing.syscalls`` (the table in ``bench/README.md``).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# One row of ``strace -c``'s table: "% time, seconds, usecs/call, calls, [errors], syscall".
_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:(\d+)\s+)?([a-z_0-9]+)\s*$")


def strace_path() -> str | None:
    """The strace binary, or None (tests skip with a reason)."""
    return shutil.which("strace")


def parse_strace_c(text: str) -> dict[str, int]:
    """Calls per system call name from ``strace -c`` output (the "total" row left out)."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m is not None and m.group(3) != "total":
            counts[m.group(3)] = counts.get(m.group(3), 0) + int(m.group(1))
    return counts


class SyscallCounter:
    """``strace -f -c -p <pid>`` around a block: ``with counter.counting(): ...`` then :attr:`counts`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.counts: dict[str, int] = {}

    @contextmanager
    def counting(self) -> Iterator[None]:
        strace = strace_path()
        if strace is None:
            raise RuntimeError("strace is not installed")
        with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
            argv = [strace, "-f", "-c", "-o", out.name, "-p", str(self.pid)]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            assert proc.stderr is not None
            # strace says "Process N attached" (one line per thread) on stderr once it traces.
            if not proc.stderr.readline():
                raise RuntimeError(f"strace could not attach to {self.pid}: exit {proc.wait()}")
            time.sleep(0.2)  # the other threads' attach lines
            try:
                yield
            finally:
                proc.send_signal(signal.SIGINT)  # detaches and writes the summary
                proc.wait(30)
                proc.stderr.close()
                self.counts = parse_strace_c(Path(out.name).read_text())


async def _connections(mesh: object, n: int) -> None:
    from ztunnel.testing import TwoNodeMesh

    assert isinstance(mesh, TwoNodeMesh)
    for _ in range(n):
        reader, writer = await mesh.socks5()
        writer.write(b"x")
        assert await reader.readexactly(1) == b"x"
        writer.close()
        await writer.wait_closed()
    await asyncio.sleep(0.5)  # both proxies finish closing the last connection before strace detaches


def per_connection_table(n: int, workdir: Path, extra_env: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    """System calls per connection on node A (SOCKS5 in, HBONE out) and node B (HBONE in, app out): ``n``
    connections of SOCKS5 + 1-byte echo + close, after three warm-up connections (pool, certificates, caches)."""
    from ztunnel.testing import EchoServer, TwoNodeMesh, ZtunnelProcess

    mesh = TwoNodeMesh(workdir)
    env = {"ZTUNNEL_INLINE_DATA_PLANE": "true", **(extra_env or {})}
    node_b = ZtunnelProcess(mesh.env_b(**env), workdir / "b.log").start()
    try:
        node_a = ZtunnelProcess(mesh.env_a(**env), workdir / "a.log").start()
        try:
            assert node_a.proc is not None and node_b.proc is not None
            counters = {"a": SyscallCounter(node_a.proc.pid), "b": SyscallCounter(node_b.proc.pid)}

            async def run() -> None:
                echo = await EchoServer().start(*mesh.server_app)
                try:
                    await _connections(mesh, 3)  # warm-up
                    with counters["a"].counting(), counters["b"].counting():
                        await _connections(mesh, n)
                finally:
                    await echo.stop()

            asyncio.run(run())
        finally:
            node_a.stop()
    finally:
        node_b.stop()
    return {side: {k: v / n for k, v in c.counts.items()} for side, c in counters.items()}


def main() -> None:
    """Print the per-connection table (markdown) for ``n`` connections (argv[1], default 200), at the bench's log
    level (``RUST_LOG=warn``: no access-log line, so none of the log writer thread's ``futex`` wake-ups)."""
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    with tempfile.TemporaryDirectory() as d:
        table = per_connection_table(n, Path(d), {"RUST_LOG": "warn"})
    names = sorted(set(table["a"]) | set(table["b"]), key=lambda k: -(table["a"].get(k, 0) + table["b"].get(k, 0)))
    print(f"| system call (n={n}) | node A (SOCKS5 in, HBONE out) | node B (HBONE in, app out) |")
    print("|---|---|---|")
    for k in names:
        print(f"| `{k}` | {table['a'].get(k, 0):.1f} | {table['b'].get(k, 0):.1f} |")
    print(f"| total | {sum(table['a'].values()):.1f} | {sum(table['b'].values()):.1f} |")


if __name__ == "__main__":
    main()
