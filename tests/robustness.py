"""Resource bounds of real ztunnel processes at scale: idle tunnels and stalled TLS handshakes, measured per process.

Idle tunnels: two ztunnel processes (:class:`~ztunnel.testing.ZtunnelProcess`, so each one's RSS is its own) on a
random block of loopback (:class:`~ztunnel.testing.TwoNodeMesh`). N clients connect to node A's SOCKS5 listener and
ask for the echo service; A carries each one as a stream of a pooled HBONE connection to B (100 streams per
connection), B connects each stream to the echo app (a process of its own). Every tunnel exchanges one small message
and then stays open and idle, so node A holds N client sockets and N streams, node B N streams and N app sockets.

Stalled handshakes: N connections to node B's 15008 that never finish the TLS handshake (half send nothing, half
send half a ClientHello), held until ztunnel's handshake timeout (10 s) cuts them.

``make robustness`` runs both (10,000 tunnels, 2,000 handshakes) and prints each process's RSS and descriptors
before, under load and after, and KiB per tunnel / per stalled handshake. The test suite runs smaller variants with
generous bounds (tests/proxy/test_resource_bounds.py, tests/proxy/test_tls_abuse.py).

The processes run with the image's glibc malloc settings (Dockerfile), which is how ztunnel runs in production.
The helpers here (``/proc`` sampling, raising the fd limit, opening tunnels) are shared with the soak
(``tests/soak.py``) and those tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from ztunnel.testing import EchoServer, TwoNodeMesh, ZtunnelProcess

# The Dockerfile's runtime environment for glibc malloc (see the comment there).
IMAGE_MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_THRESHOLD_": "4194304",
    "MALLOC_TRIM_THRESHOLD_": "268435456",
    "MALLOC_TOP_PAD_": "67108864",
}
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- /proc sampling -------------------------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (``VmRSS``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14 and 15 of stat(5))


def pid_of(node: ZtunnelProcess) -> int:
    """The ztunnel's control process (admin, stats, readiness)."""
    assert node.proc is not None
    return node.proc.pid


def data_plane_pid(node: ZtunnelProcess) -> int:
    """The ztunnel's one worker process, which carries every tunnel (:func:`two_nodes` runs one per node)."""
    (worker,) = node.children()
    return worker


def raise_nofile(need: int) -> int:
    """Raise this process's soft fd limit to at least ``need`` (and the hard limit, when allowed: root).

    Returns the new soft limit; raises RuntimeError naming the limit when it cannot be had.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
            return need
        except (ValueError, OSError):
            raise RuntimeError(f"need {need} file descriptors, hard limit is {hard} (raise it: ulimit -Hn)") from None
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need


# -- nodes and tunnels ----------------------------------------------------------------------------------------------


@contextmanager
def two_nodes(workdir: Path, mesh: TwoNodeMesh, **extra: str) -> Iterator[tuple[ZtunnelProcess, ZtunnelProcess]]:
    """Node B then node A as processes (image malloc settings plus ``extra``), stopped on exit. Each runs one worker
    process, so a node's data plane is one process to measure (:func:`data_plane_pid`)."""
    env = {**IMAGE_MALLOC_ENV, "ZTUNNEL_WORKER_THREADS": "1", **extra}
    b = ZtunnelProcess(mesh.env_b(**env), workdir / "b.log").start()
    try:
        a = ZtunnelProcess(mesh.env_a(**env), workdir / "a.log").start()
        try:
            yield a, b
        finally:
            a.stop()
    finally:
        b.stop()


Tunnel = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def socks5_tunnel(proxy: tuple[str, int], dst: tuple[str, int]) -> Tunnel:
    """A SOCKS5 CONNECT through ``proxy`` (no auth, IPv4); ConnectionError with the reply code on failure.

    Unlike :func:`ztunnel.testing.socks5_connect`, the socket is closed whatever goes wrong (a proxy that closes the
    connection mid-handshake, a cancellation), so thousands of failed attempts leak nothing.
    """
    reader, writer = await asyncio.open_connection(*proxy)
    try:
        writer.write(b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton(dst[0]) + dst[1].to_bytes(2, "big"))
        reply = await reader.readexactly(2 + 10)
        if reply[:2] != b"\x05\x00":
            raise ConnectionError("SOCKS5 method negotiation failed")
        if reply[3] != 0:
            raise ConnectionError(f"SOCKS5 reply {reply[3]}")
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def open_tunnels(mesh: TwoNodeMesh, n: int, concurrency: int = 64, message: bytes = b"x" * 64) -> list[Tunnel]:
    """``n`` SOCKS5 -> HBONE tunnels to the echo service, each of which echoed ``message`` once; left open."""
    tunnels: list[Tunnel] = []
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            reader, writer = await socks5_tunnel((mesh.node_a, 15080), mesh.vip)
            try:
                writer.write(message)
                got = await reader.readexactly(len(message))
                assert got == message
            except BaseException:
                writer.close()
                raise
            tunnels.append((reader, writer))

    results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_tunnels(tunnels)
        raise RuntimeError(f"{len(errors)} of {n} tunnels failed; first: {errors[0]!r}") from errors[0]
    return tunnels


async def close_tunnels(tunnels: list[Tunnel]) -> None:
    """Close the tunnels' sockets (and let the loop send the FINs before anything blocks it)."""
    for _, writer in tunnels:
        writer.close()
    tunnels.clear()
    await asyncio.sleep(0.05)


async def settle(pids: list[int], quiet: float = 0.5, timeout: float = 30.0) -> None:
    """Wait until the processes' fd counts stop changing for ``quiet`` seconds (connections finished closing)."""
    last = [fd_count(p) for p in pids]
    stable_since = time.monotonic()
    deadline = stable_since + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        now = [fd_count(p) for p in pids]
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= quiet:
            return


@dataclass
class Sample:
    rss_kib: int
    fds: int

    @classmethod
    def of(cls, pid: int) -> Sample:
        return cls(rss_kib(pid), fd_count(pid))


@dataclass
class IdleTunnels:
    """RSS and fds of both processes: warmed up (one tunnel opened and closed), with ``n`` tunnels, and after."""

    n: int
    before: dict[str, Sample]
    loaded: dict[str, Sample]
    after: dict[str, Sample]
    seconds_to_open: float

    def kib_per_tunnel(self, node: str) -> float:
        return (self.loaded[node].rss_kib - self.before[node].rss_kib) / self.n

    def report(self) -> str:
        lines = [f"{self.n} idle SOCKS5 -> HBONE tunnels (opened in {self.seconds_to_open:.1f}s)"]
        for node, role in (("a", "client side, SOCKS5 + HBONE streams"), ("b", "server side, streams + app sockets")):
            b, lo, af = self.before[node], self.loaded[node], self.after[node]
            lines.append(
                f"  node {node.upper()} ({role}): RSS {b.rss_kib / 1024:.1f} -> {lo.rss_kib / 1024:.1f} MiB "
                f"({self.kib_per_tunnel(node):.1f} KiB/tunnel), {af.rss_kib / 1024:.1f} MiB after closing; "
                f"fds {b.fds} -> {lo.fds} -> {af.fds}"
            )
        return "\n".join(lines)


@contextmanager
def echo_process(addr: tuple[str, int]) -> Iterator[subprocess.Popen[bytes]]:
    """The echo app in a process of its own (its sockets do not count against the driver's fd limit)."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.robustness", "--echo", f"{addr[0]}:{addr[1]}"])
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(addr, timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"echo app on {addr} did not start") from None
                time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        proc.wait()


async def _serve_echo(host: str, port: int) -> None:
    raise_nofile(resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    await EchoServer().start(host, port)
    await asyncio.Event().wait()


async def measure_idle_tunnels(workdir: Path, n: int, **extra_env: str) -> IdleTunnels:
    """Open ``n`` idle tunnels through two ztunnel processes and sample each process (see the module docstring)."""
    raise_nofile(n + 512)
    mesh = TwoNodeMesh(workdir)
    with echo_process(mesh.server_app), two_nodes(workdir, mesh, **extra_env) as (a, b):
        pids = {"a": data_plane_pid(a), "b": data_plane_pid(b)}
        # Warm up: the first tunnel dials the HBONE connection, fetches certificates, imports lazily.
        await close_tunnels(await open_tunnels(mesh, 1))
        await settle(list(pids.values()))
        before = {k: Sample.of(p) for k, p in pids.items()}
        start = time.monotonic()
        tunnels = await open_tunnels(mesh, n)
        opened = time.monotonic() - start
        await settle(list(pids.values()))
        loaded = {k: Sample.of(p) for k, p in pids.items()}
        await close_tunnels(tunnels)
        await settle(list(pids.values()))
        after = {k: Sample.of(p) for k, p in pids.items()}
        return IdleTunnels(n, before, loaded, after, opened)


def client_hello() -> bytes:
    """A real TLS ClientHello (a client's first flight), from an in-memory handshake."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing)
    with suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


@dataclass
class StalledHandshakes:
    """Node B with ``n`` connections to 15008 that never finish their TLS handshake, and after the timeout."""

    n: int
    before: Sample
    loaded: Sample
    after: Sample
    seconds_to_cut: float

    def kib_each(self) -> float:
        return (self.loaded.rss_kib - self.before.rss_kib) / self.n

    def report(self) -> str:
        b, lo, af = self.before, self.loaded, self.after
        return (
            f"{self.n} stalled TLS handshakes at node B's 15008 (half send nothing, half half a ClientHello)\n"
            f"  node B: RSS {b.rss_kib / 1024:.1f} -> {lo.rss_kib / 1024:.1f} MiB ({self.kib_each():.1f} KiB each), "
            f"fds {b.fds} -> {lo.fds}; all cut {self.seconds_to_cut:.1f}s after the last one arrived "
            f"(fds {af.fds}, RSS {af.rss_kib / 1024:.1f} MiB)"
        )


async def measure_stalled_handshakes(workdir: Path, n: int) -> StalledHandshakes:
    """Open ``n`` stalled handshakes to a node B process and wait for its handshake timeout to cut them."""
    raise_nofile(n + 512)
    mesh = TwoNodeMesh(workdir)
    hello = client_hello()
    b = ZtunnelProcess(mesh.env_b(**IMAGE_MALLOC_ENV, ZTUNNEL_WORKER_THREADS="1"), workdir / "b.log").start()
    socks: list[socket.socket] = []
    try:
        pid = data_plane_pid(b)
        await settle([pid])
        before = Sample.of(pid)
        loop = asyncio.get_running_loop()
        for i in range(n):
            s = socket.socket()
            s.setblocking(False)
            socks.append(s)
            await loop.sock_connect(s, (mesh.node_b, 15008))
            if i % 2:
                s.send(hello[: len(hello) // 2])
            if i % 100 == 99:
                # Keep to the accept rate: past the listen backlog the kernel drops handshakes and retries them
                # seconds later, which would spread the flood out instead of stacking it up.
                while fd_count(pid) < before.fds + i - 100:
                    await asyncio.sleep(0.01)
        while fd_count(pid) < before.fds + n:
            await asyncio.sleep(0.01)
        loaded = Sample.of(pid)
        start = time.monotonic()
        while fd_count(pid) > before.fds and time.monotonic() - start < 60:
            await asyncio.sleep(0.1)
        return StalledHandshakes(n, before, loaded, Sample.of(pid), time.monotonic() - start)
    finally:
        for s in socks:
            s.close()
        b.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tunnels", type=int, default=10_000, help="idle tunnels (default 10,000; 0: skip)")
    parser.add_argument("--stalled", type=int, default=2_000, help="stalled TLS handshakes (default 2,000; 0: skip)")
    parser.add_argument("--echo", metavar="HOST:PORT", help=argparse.SUPPRESS)  # the echo app's own process
    args = parser.parse_args(argv)
    import uvloop

    if args.echo:
        host, _, port = args.echo.rpartition(":")
        uvloop.run(_serve_echo(host, int(port)))
        return 0

    if args.tunnels:
        with tempfile.TemporaryDirectory(prefix="ztunnel-robustness-") as tmp:
            print(uvloop.run(measure_idle_tunnels(Path(tmp), args.tunnels)).report(), flush=True)
    if args.stalled:
        with tempfile.TemporaryDirectory(prefix="ztunnel-robustness-") as tmp:
            print(uvloop.run(measure_stalled_handshakes(Path(tmp), args.stalled)).report(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
