"""Latency: ping-pong round trips of 64 B and 1 KiB, percentiles and proxy CPU per round trip."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from bench.clients import WorkerError
from bench.scenarios.base import DataScenario, process_split, proxy_cpu
from bench.topology import PATH_PROXIES, Topology


class Latency(DataScenario):
    name = "latency"

    def seconds(self) -> float:
        return len(self.p.latency_sizes) * len(self.ctx.modes) * self._case_seconds()

    def _case_seconds(self) -> float:
        return 0.2 + (self.p.latency_count + self.p.latency_warmup) * 150e-6

    def run(self, topo: Topology, rep: int, order: Sequence[str]) -> None:
        for size in self.p.latency_sizes:
            self._case(topo, rep, order, size)

    def _case(self, topo: Topology, rep: int, order: Sequence[str], size: int) -> None:
        """Ping-pong for every mode, in ``latency_slices`` slices taken in turn (direct, tcp, hbone, envoy, direct,
        ...), each on a new connection: round-trip times drift with where the scheduler puts the processes, and
        slicing spreads that drift over all modes instead of handing it to whichever ran at the time."""
        ctx = self.ctx
        case = size_label(size)
        slices = max(1, self.p.latency_slices)
        per_slice = max(1, self.p.latency_count // slices)
        warmup = max(1, self.p.latency_warmup // slices)
        rtts: dict[str, list[float]] = {m: [] for m in order}
        cpu: dict[str, dict[str, float]] = {m: {} for m in order}
        window: dict[str, float] = dict.fromkeys(order, 0.0)
        failed: dict[str, WorkerError] = {}
        for _ in range(slices):
            for mode in order:
                if mode in failed:
                    continue
                route = topo.route(mode)
                cmd = {
                    "op": "latency",
                    "route": route,
                    "size": size,
                    "count": per_slice,
                    "warmup": warmup,
                    "stall_timeout": self.p.stall_timeout,
                    "pids": ctx.pids(topo, route),
                }
                try:
                    res = ctx.call(cmd, timeout=60 + per_slice * 0.01)
                except WorkerError as e:
                    failed[mode] = e
                    continue
                rtts[mode] += res["rtt_us"]
                window[mode] += res["cpu_window_s"]
                for name, seconds in res["cpu"].items():
                    cpu[mode][name] = cpu[mode].get(name, 0.0) + seconds
        for mode in order:
            if mode in failed:
                ctx.recorder.failed("latency", case, mode, rep, failed[mode])
                continue
            pct = percentiles(rtts[mode])
            mode_cpu = proxy_cpu(mode, cpu[mode])
            n = len(rtts[mode])
            metrics = {
                **{k: round(v, 1) for k, v in pct.items()},
                "count": n,
                "slices": slices,
                "proxy_cpu_us_per_rt": round(mode_cpu / n * 1e6, 2) if PATH_PROXIES[mode] else None,
                "cpu_s": {k: round(v, 6) for k, v in cpu[mode].items()},
                **process_split(mode, cpu[mode], window[mode]),
            }
            ctx.recorder.add("latency", case, mode, rep, metrics, rtt_us=rtts[mode])
            ctx.progress.step(
                self._case_seconds(),
                f"rep {rep + 1} latency    {case:<9} {mode:<6} p50 {pct['p50']:.0f} µs, p99 {pct['p99']:.0f} µs, "
                f"p99.9 {pct['p99.9']:.0f} µs",
            )


def size_label(n: int) -> str:
    return f"{n // 1024} KiB" if n >= 1024 and n % 1024 == 0 else f"{n} B"


def percentiles(values: Sequence[float]) -> dict[str, float]:
    s = sorted(values)
    n = len(s)
    out = {f"p{q:g}": s[min(n - 1, int(q / 100 * n))] for q in (50, 90, 99, 99.9)}
    out["mean"] = statistics.fmean(s)
    out["min"], out["max"] = s[0], s[-1]
    return out
