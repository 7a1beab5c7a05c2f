"""Soak: mixed traffic through two ztunnel processes for a long time; memory must not grow, descriptors must come back.

``make soak`` runs ``python -m tests.soak`` (10 minutes). Two ztunnel processes (node A, the client side; node B,
the server side; the image's malloc settings, ``tests/robustness.py``), an echo app behind node B and a plain
(non-mesh) echo app, each in a process of its own. The driver runs five kinds of traffic at once:

* short: connect through SOCKS5 -> HBONE, 1 KiB each way, close (4 in parallel, back to back);
* long: 32 tunnels that stay open and exchange 100 bytes every second, each replaced after about a minute;
* bulk: 16 MiB each way on one tunnel, sha256-checked, every 2 s;
* churn: every 10 s, 200 tunnels opened at once, held 2 s, closed;
* passthrough: short connections through SOCKS5 to the plain app (plain TCP, no HBONE), 2 in parallel.

Every second it samples each process's RSS, descriptors and CPU time. Pass when (a) no connection failed or lost a
byte, (b) RSS over the last 30 s of traffic (median) is within 10 % of RSS over the 30 s after warm-up (median), and
(c) once the traffic stops and the pooled HBONE connections have been released as idle
(``POOL_UNUSED_RELEASE_TIMEOUT``, shortened here), each process holds exactly the descriptors it held before any
traffic. Exit status 0 on pass, 1 on fail, with a summary either way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.robustness import (
    Tunnel,
    cpu_seconds,
    data_plane_pid,
    echo_process,
    fd_count,
    raise_nofile,
    rss_kib,
    settle,
    socks5_tunnel,
    two_nodes,
)
from ztunnel.testing import TwoNodeMesh, send_and_read_echo

MiB = 1024 * 1024
PLAIN_PORT = 9000
RSS_GROWTH_LIMIT = 0.10


@dataclass
class Kind:
    """Counters of one kind of traffic."""

    connections: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, e: BaseException) -> None:
        self.errors.append(f"{type(e).__name__}: {e}")


@dataclass
class Point:
    t: float
    rss: dict[str, int]
    fds: dict[str, int]
    cpu: dict[str, float]


class Soak:
    def __init__(self, mesh: TwoNodeMesh, pids: dict[str, int]) -> None:
        self.mesh = mesh
        self.pids = pids
        self.kinds = {k: Kind() for k in ("short", "long", "bulk", "churn", "passthrough")}
        self.stop = asyncio.Event()
        self.samples: list[Point] = []
        self.start = time.monotonic()

    # -- traffic ---------------------------------------------------------------------------------------------------

    async def tunnel(self, plain: bool = False) -> Tunnel:
        dst = (self.mesh.plain, PLAIN_PORT) if plain else self.mesh.vip
        return await asyncio.wait_for(socks5_tunnel((self.mesh.node_a, 15080), dst), 30)

    async def exchange(self, kind: str, plain: bool = False, size: int = 1024) -> None:
        k = self.kinds[kind]
        try:
            reader, writer = await self.tunnel(plain)
            try:
                payload = os.urandom(size)
                writer.write(payload)
                writer.write_eof()
                back = await asyncio.wait_for(reader.read(-1), 30)
                if back != payload:
                    raise AssertionError(f"{len(back)} of {size} bytes came back intact")
                k.connections += 1
                k.bytes += 2 * size
            finally:
                writer.close()
        except (OSError, EOFError, AssertionError, TimeoutError) as e:
            k.fail(e)

    async def short(self, plain: bool = False) -> None:
        while not self.stop.is_set():
            await self.exchange("passthrough" if plain else "short", plain)

    async def long(self, slot: int) -> None:
        k = self.kinds["long"]
        with contextlib.suppress(TimeoutError):  # spread the replacements over the minute
            await asyncio.wait_for(self.stop.wait(), slot * 60 / 32)
        while not self.stop.is_set():
            try:
                reader, writer = await self.tunnel()
                k.connections += 1
                try:
                    until = time.monotonic() + 60
                    while time.monotonic() < until and not self.stop.is_set():
                        msg = os.urandom(100)
                        writer.write(msg)
                        if await asyncio.wait_for(reader.readexactly(100), 30) != msg:
                            raise AssertionError("long stream echoed different bytes")
                        k.bytes += 200
                        await asyncio.sleep(1)
                finally:
                    writer.close()
            except (OSError, EOFError, AssertionError, TimeoutError) as e:
                k.fail(e)
                await asyncio.sleep(1)

    async def bulk(self) -> None:
        k = self.kinds["bulk"]
        block = os.urandom(MiB)
        while not self.stop.is_set():
            try:
                await self.bulk_once(block, 16)
                k.connections += 1
                k.bytes += 32 * MiB
            except (OSError, EOFError, AssertionError, TimeoutError) as e:
                k.fail(e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 2)  # bulk now and then, not a throughput test

    async def bulk_once(self, block: bytes, mib: int) -> None:
        reader, writer = await self.tunnel()
        echoed = await send_and_read_echo(reader, writer, block, mib, 120)
        if echoed.received != mib * MiB or echoed.got_sha256 != echoed.sent_sha256:
            raise AssertionError(
                f"bulk: {echoed.received} of {mib * MiB} bytes back, sha256 differs: "
                f"{echoed.got_sha256 != echoed.sent_sha256}"
            )

    async def churn(self) -> None:
        k = self.kinds["churn"]
        while not self.stop.is_set():
            results = await asyncio.gather(*(self.tunnel() for _ in range(200)), return_exceptions=True)
            tunnels = [r for r in results if not isinstance(r, BaseException)]
            for r in results:
                if isinstance(r, BaseException):
                    k.fail(r)
            k.connections += len(tunnels)
            await asyncio.sleep(2)
            for _, w in tunnels:
                w.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 8)

    # -- sampling --------------------------------------------------------------------------------------------------

    def sample(self) -> Point:
        return Point(
            time.monotonic() - self.start,
            {n: rss_kib(p) for n, p in self.pids.items()},
            {n: fd_count(p) for n, p in self.pids.items()},
            {n: cpu_seconds(p) for n, p in self.pids.items()},
        )

    async def sampler(self, every: float, report_every: float) -> None:
        next_report = report_every
        while not self.stop.is_set():
            p = self.sample()
            self.samples.append(p)
            if p.t >= next_report:
                next_report += report_every
                conns = sum(k.connections for k in self.kinds.values())
                errors = sum(len(k.errors) for k in self.kinds.values())
                print(
                    f"  {p.t:5.0f}s  RSS A {p.rss['a'] / 1024:6.1f} MiB  B {p.rss['b'] / 1024:6.1f} MiB  "
                    f"fds A {p.fds['a']:4d} B {p.fds['b']:4d}  CPU A {p.cpu['a']:6.1f}s B {p.cpu['b']:6.1f}s  "
                    f"connections {conns}  errors {errors}",
                    flush=True,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), every)

    def median_rss(self, node: str, start: float, end: float) -> float:
        values = [p.rss[node] for p in self.samples if start <= p.t <= end]
        return statistics.median(values) if values else float("nan")


def fds_back(now: Point, baseline: Point) -> bool:
    return all(now.fds[n] <= baseline.fds[n] for n in baseline.fds)


async def run(workdir: Path, duration: float, warmup: float, pool_release: float, check_rss: bool = True) -> list[str]:
    """The soak; prints a summary and returns what failed (nothing: pass). ``check_rss=False`` for a run too short
    to have a steady state (the test suite's smoke run)."""
    raise_nofile(4096)
    mesh = TwoNodeMesh(workdir)
    env = {"POOL_UNUSED_RELEASE_TIMEOUT": f"{pool_release:g}s"}
    with (
        echo_process(mesh.server_app),
        echo_process((mesh.plain, PLAIN_PORT)),
        two_nodes(workdir, mesh, **env) as (a, b),
    ):
        pids = {"a": data_plane_pid(a), "b": data_plane_pid(b)}
        soak = Soak(mesh, pids)
        await settle(list(pids.values()))  # the readiness probes' connections are gone
        baseline = soak.sample()
        print(
            f"soak: {duration:g}s of mixed traffic, warm-up {warmup:g}s; node A pid {pids['a']}, node B pid {pids['b']}; "
            f"logs in {workdir}",
            flush=True,
        )
        workers = [
            *(soak.short() for _ in range(4)),
            *(soak.short(plain=True) for _ in range(2)),
            *(soak.long(i) for i in range(32)),
            soak.bulk(),
            soak.churn(),
        ]
        tasks = [asyncio.ensure_future(w) for w in workers]  # noqa: TID251 - driver tasks, gathered below
        sampling = asyncio.ensure_future(soak.sampler(1.0, max(10.0, duration / 20)))  # noqa: TID251
        await asyncio.sleep(duration)
        soak.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
        await sampling
        end_of_traffic = soak.samples[-1].t if soak.samples else duration

        # Descriptors back to the baseline once the idle pooled connections have been released.
        deadline = time.monotonic() + pool_release * 2 + 60
        final = soak.sample()
        while not fds_back(final, baseline) and time.monotonic() < deadline:
            await asyncio.sleep(1)
            final = soak.sample()

    failures: list[str] = []
    print(f"\ntraffic (over {end_of_traffic:.0f}s):")
    for name, k in soak.kinds.items():
        print(f"  {name:12s} {k.connections:8d} connections {k.bytes / MiB:10.1f} MiB  {len(k.errors)} errors")
        if k.errors:
            failures.append(f"{name}: {len(k.errors)} errors, first: {k.errors[0]}")
    print("processes:")
    window = min(30.0, (end_of_traffic - warmup) / 2)  # shorter for a short run
    for node in ("a", "b"):
        warm = soak.median_rss(node, warmup, warmup + window)
        end = soak.median_rss(node, end_of_traffic - window, end_of_traffic)
        peak = max(p.rss[node] for p in soak.samples)
        growth = end / warm - 1
        print(
            f"  node {node.upper()}: RSS at start {baseline.rss[node] / 1024:.1f} MiB, after warm-up {warm / 1024:.1f} MiB, "
            f"at the end {end / 1024:.1f} MiB ({growth:+.1%}), peak {peak / 1024:.1f} MiB; "
            f"fds at start {baseline.fds[node]}, peak {max(p.fds[node] for p in soak.samples)}, "
            f"after {final.fds[node]}; CPU {final.cpu[node]:.0f}s"
        )
        if check_rss and not growth <= RSS_GROWTH_LIMIT:
            failures.append(f"node {node.upper()}: RSS grew {growth:+.1%} after warm-up (limit {RSS_GROWTH_LIMIT:.0%})")
        if final.fds[node] > baseline.fds[node]:
            failures.append(f"node {node.upper()}: {final.fds[node]} descriptors open, {baseline.fds[node]} at start")
    print("FAIL:\n  " + "\n  ".join(failures) if failures else "PASS")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds before the RSS reference (default 120)")
    parser.add_argument(
        "--pool-release", type=float, default=15.0, help="POOL_UNUSED_RELEASE_TIMEOUT for the nodes, seconds"
    )
    parser.add_argument("--workdir", type=Path, help="keep the nodes' logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    import uvloop

    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        failures = uvloop.run(run(args.workdir, args.duration, args.warmup, args.pool_release))
    else:
        with tempfile.TemporaryDirectory(prefix="ztunnel-soak-") as tmp:
            failures = uvloop.run(run(Path(tmp), args.duration, args.warmup, args.pool_release))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
